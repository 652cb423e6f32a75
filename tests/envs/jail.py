"""Whether the kernel jail (`Sandbox(isolation="bwrap")`) works here, for the sandbox tests.

Tests that need it skip with the reason the sandbox gives; CI sets
TRACE_MEGA_REQUIRE_JAIL=1 (`.ci/run`), which turns that skip into a failure,
so the attack suite cannot pass there without the jail.
"""

import os
from functools import lru_cache
from typing import Optional

import pytest

from trace_mega.envs.sandbox import Sandbox, SandboxLimits


@lru_cache(maxsize=1)
def jail_problem() -> Optional[str]:
    try:
        Sandbox(limits=SandboxLimits(wall_s=30.0), max_workers=1).close()
    except RuntimeError as err:
        return str(err)
    return None


def require_jail() -> None:
    problem = jail_problem()
    if problem is None:
        return
    if os.environ.get("TRACE_MEGA_REQUIRE_JAIL") == "1":
        pytest.fail(f"TRACE_MEGA_REQUIRE_JAIL=1 but the jail is unavailable: {problem}")
    pytest.skip(f"the kernel jail is unavailable here (fork/thread bombs never run on the bare host): {problem}")
