"""Math with a Python interpreter tool (`math_python`).

The `python` tool runs each call's code in a fresh contained interpreter
(`trace_mega.envs.sandbox`), so a call never sees another call's variables.
By default the interpreter runs in the kernel jail (bubblewrap, its own uid,
no network); building the env fails where that is unavailable unless the
option `isolation: weak` opts out of it.
The reward is `math_verify`: the gold answer is parsed as LaTeX (wrapped in
`\\boxed{}`), the final answer with LaTeX and plain-expression extraction (a
`\\boxed{}` inside the answer wins), and `verify` compares them symbolically.

`load_math` reads JSONL / JSON / Parquet files in the usual layouts: DeepScaler
(`problem` / `answer` / `solution`), MATH-style (`problem` / `solution` with
the answer in the last `\\boxed{}`, optional `answer`), AIME / AMC / Minerva
(`question` or `Problem` / `Answer`), OlympiadBench (`final_answer` list) and
verl parquet (`prompt` messages, `reward_model.ground_truth`, `data_source`).
A split may join several files (one per benchmark: AIME24, AMC23, MATH500, ...);
each task's `meta["source"]` names its benchmark. Ten problems ship in
`trace_mega/data/math/problems.jsonl`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.records import as_paths, check_on_bad_row, load_rows
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


# Field names of the usual math files, tried in order: DeepScaler / MATH / MATH500 / AIME
# (`problem`, `answer`), AMC / Minerva (`question`), OlympiadBench (`final_answer`, a list),
# verl parquet (`prompt` chat messages, `reward_model.ground_truth`, `data_source`).
PROBLEM_FIELDS = ("problem", "Problem", "question", "Question", "prompt")
ANSWER_FIELDS = ("answer", "Answer", "final_answer", "ground_truth", "expected_answer", "target")
ID_FIELDS = ("unique_id", "id", "ID", "idx", "problem_id")


def _problem_text(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # chat messages: the last user turn
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users else None
    return None


def _answer_text(row: dict[str, Any]) -> Optional[str]:
    value = next((row[k] for k in ANSWER_FIELDS if row.get(k) is not None), None)
    if value is None and isinstance(row.get("reward_model"), dict):
        value = row["reward_model"].get("ground_truth")
    if isinstance(value, list):  # OlympiadBench: one string per sub-answer
        value = ", ".join(str(v) for v in value)
    if value is None and isinstance(row.get("solution"), str):
        value = last_boxed(row["solution"])
    if value is None:
        return None
    text = str(value).strip()
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


def load_math(path: str | Path, source: Optional[str] = None, on_bad_row: str = "error") -> list[Task]:
    """Tasks of a math file (JSONL / JSON / Parquet; layout detected per row, see the field lists).

    `meta["source"]` (the benchmark in evaluation reports) is `source`, else the row's
    `data_source` / `source` field, else the file name without its suffix. A row without a
    problem or an answer raises `DataError` naming its place (`data/aime.jsonl:17: ...`), or is
    skipped (`on_bad_row="skip"`, one warning per file; `records.load_rows`).
    """
    path = Path(path)

    def make(n: int, row: dict[str, Any]) -> Task:
        problem = next((t for t in (_problem_text(row.get(k)) for k in PROBLEM_FIELDS) if t), None)
        if problem is None:
            raise ValueError(f"a math row needs one of the fields {', '.join(PROBLEM_FIELDS)} (a non-empty problem)")
        answer = _answer_text(row)
        if not answer:
            raise ValueError(f"no answer field ({', '.join(ANSWER_FIELDS)}) and no \\boxed{{}} in 'solution'")
        meta = {k: row[k] for k in ("level", "type", "subject", "unique_id") if k in row}
        meta["source"] = str(source or row.get("data_source") or row.get("source") or path.stem)
        key = next((k for k in ID_FIELDS if row.get(k) is not None), None)
        if key == "unique_id":
            task_id = str(row[key])
        else:
            task_id = f"{path.stem}-{row[key] if key else n}"
        return Task(
            task_id=task_id,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}],
            tools=[PYTHON_TOOL],
            gold_answer=answer,
            meta=meta,
        )

    return load_rows(path, make, on_bad_row)


def math_reward(gold: str, final_answer: Optional[str]) -> float:
    """1.0 when `math_verify` finds `final_answer` equal to `gold`, else 0.0.

    math_verify's own time limits use SIGALRM, which only the main thread may
    set; off the main thread they are switched off.
    """
    if not final_answer or not final_answer.strip():
        return 0.0
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=limit)
    answer = final_answer.strip()
    boxed = last_boxed(answer)
    if boxed is not None:
        answer = "\\boxed{" + boxed + "}"
    elif "$" not in answer:
        answer = "$" + answer + "$"
    pred = parse(answer, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=limit)
    if not gold_parsed or not pred:
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=limit) else 0.0


@ENVS.register("math_python")
class MathPythonEnv(Env):
    """Math problems with a sandboxed `python` tool and a math-verify reward.

    `train_path` / `test_path`: a file or a list of files (one per benchmark); both default
    to the ten shipped problems.
    `isolation` ("bwrap" | "weak") and `uid_base` are the sandbox's (`Sandbox`); `max_workers`
    bounds its interpreters at once (64: the agent loop runs every live episode's tool call at
    once, up to `env.max_concurrent_tool_calls`; `bench_sandbox` measures the jail at 64 at once).
    `on_bad_row`: "error" (a malformed problem row raises `DataError` naming its file, line or
    row, and field) or "skip" (bad rows are left out, one warning per file).
    """

    name = "math_python"

    def __init__(
        self,
        train_path: Optional[str | list[str]] = None,
        test_path: Optional[str | list[str]] = None,
        limits: Optional[SandboxLimits] = None,
        max_workers: int = 64,
        isolation: str = "bwrap",
        uid_base: int = DEFAULT_UID_BASE,
        on_bad_row: str = "error",
    ) -> None:
        check_on_bad_row(on_bad_row)
        self.on_bad_row = on_bad_row
        self.paths = {"train": as_paths(train_path or SHIPPED), "test": as_paths(test_path or SHIPPED)}
        if isinstance(limits, dict):  # from a YAML config's env.options
            limits = SandboxLimits(**limits)
        self.sandbox = Sandbox(limits=limits, max_workers=max_workers, isolation=isolation, uid_base=uid_base)

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.paths:
            raise ValueError(f"unknown split {split!r}; valid: {sorted(self.paths)}")
        return [t for path in self.paths[split] for t in load_math(path, on_bad_row=self.on_bad_row)]

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        state.history.append(call)
        if call.name != "python":
            return f"Error: unknown tool {call.name!r}; the only tool is 'python'."
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return "Error: the python tool needs a string argument 'code'."
        return self.sandbox.run(code).observation()

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        return math_reward(state.task.gold_answer or "", final_answer)

    def close(self) -> None:
        self.sandbox.close()
