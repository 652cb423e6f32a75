"""Math with a Python interpreter tool (`math_python`).

The `python` tool runs each call's code in a fresh contained interpreter
(`trace_mega.envs.sandbox`), so a call never sees another call's variables.
By default the interpreter runs in the kernel jail (bubblewrap, its own uid,
no network); building the env fails where that is unavailable unless the
option `isolation: weak` opts out of it.
The reward is `math_verify`: the gold answer is parsed as LaTeX (wrapped in
`\\boxed{}`), the final answer with LaTeX and plain-expression extraction (a
`\\boxed{}` inside the answer wins), and `verify` compares them symbolically.

Loaders read DeepScaler (`problem` / `answer` / `solution`) and MATH-style
(`problem` / `solution` with the answer in the last `\\boxed{}`, optional
`answer`) JSONL; ten problems ship in `trace_mega/data/math/problems.jsonl`.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.sandbox import Sandbox, SandboxLimits
from trace_mega.envs.sandbox_jail import DEFAULT_UID_BASE

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "math" / "problems.jsonl"
SYSTEM_PROMPT = (
    "Solve the math problem. You may call the `python` tool to run Python 3 code (numpy and "
    "sympy are available); each call runs in a fresh interpreter, so define everything you "
    "need in the same call and print the values you want to see. When you are done, give the "
    "final answer inside <answer>...</answer>, preferably as \\boxed{...} in LaTeX."
)
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run Python 3 code in a fresh sandboxed interpreter and return its printed output "
            "(stdout and stderr, truncated). No network, no files outside a scratch directory, "
            "limited CPU time, wall time and memory."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    starts = [i for key in ("\\boxed{", "\\fbox{") for i in _find_all(text, key)]
    if not starts:
        return None
    start = max(starts)
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _find_all(text: str, key: str) -> list[int]:
    out, at = [], text.find(key)
    while at >= 0:
        out.append(at)
        at = text.find(key, at + 1)
    return out


def load_math_jsonl(path: str | Path, source: Optional[str] = None) -> list[Task]:
    """Tasks from a DeepScaler- or MATH-style JSONL file (layout detected per row)."""
    path = Path(path)
    tasks = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if not line.strip():
                continue
            row = json.loads(line)
            if "problem" not in row:
                raise ValueError(f"{path}:{n + 1}: a math row needs a 'problem' field")
            answer = row.get("answer")
            if answer is None and "solution" in row:
                answer = last_boxed(row["solution"])
            if answer is None:
                raise ValueError(f"{path}:{n + 1}: no 'answer' and no \\boxed{{}} in 'solution'")
            meta = {k: row[k] for k in ("level", "type", "subject", "unique_id") if k in row}
            meta["source"] = source or path.stem
            tasks.append(Task(
                task_id=str(row.get("unique_id", f"{path.stem}-{n}")),
                messages=[{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": row["problem"]}],
                tools=[PYTHON_TOOL],
                gold_answer=str(answer).strip(),
                meta=meta,
            ))
    return tasks


def math_reward(gold: str, final_answer: Optional[str]) -> float:
    """1.0 when `math_verify` finds `final_answer` equal to `gold`, else 0.0.

    math_verify's own time limits use SIGALRM, which only the main thread may
    set; off the main thread they are switched off.
    """
    if not final_answer or not final_answer.strip():
        return 0.0
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()],
                        parsing_timeout=limit)
    answer = final_answer.strip()
    boxed = last_boxed(answer)
    if boxed is not None:
        answer = "\\boxed{" + boxed + "}"
    elif "$" not in answer:
        answer = "$" + answer + "$"
    pred = parse(answer, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=limit)
    if not gold_parsed or not pred:
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=limit) else 0.0


@ENVS.register("math_python")
class MathPythonEnv(Env):
    """Math problems with a sandboxed `python` tool and a math-verify reward.

    `train_path` / `test_path` default to the ten shipped problems (both splits).
    `isolation` ("bwrap" | "weak") and `uid_base` are the sandbox's (`Sandbox`).
    """

    name = "math_python"

    def __init__(
        self,
        train_path: Optional[str] = None,
        test_path: Optional[str] = None,
        limits: Optional[SandboxLimits] = None,
        max_workers: int = 4,
        isolation: str = "bwrap",
        uid_base: int = DEFAULT_UID_BASE,
    ) -> None:
        self.paths = {"train": Path(train_path or SHIPPED), "test": Path(test_path or SHIPPED)}
        if isinstance(limits, dict):  # from a YAML config's env.options
            limits = SandboxLimits(**limits)
        self.sandbox = Sandbox(limits=limits, max_workers=max_workers, isolation=isolation, uid_base=uid_base)
        self._pool: Optional[ThreadPoolExecutor] = None

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.paths:
            raise ValueError(f"unknown split {split!r}; valid: {sorted(self.paths)}")
        return load_math_jsonl(self.paths[split])

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        state.history.append(call)
        if call.name != "python":
            return f"Error: unknown tool {call.name!r}; the only tool is 'python'."
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return "Error: the python tool needs a string argument 'code'."
        return self.sandbox.run(code).observation()

    def step_many(self, items: Sequence[tuple[EpisodeState, ToolCall]]) -> list[str]:
        """`step` for many episodes at once on a bounded pool (the sandbox's worker count)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.sandbox.max_workers, thread_name_prefix="math-step")
        return list(self._pool.map(lambda item: self.step(*item), items))

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        return math_reward(state.task.gold_answer or "", final_answer)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.sandbox.close()
