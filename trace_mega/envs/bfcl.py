"""BFCL v4 multi-turn function calling (`bfcl_multi_turn`).

Data, API simulators and the reward all come from the `bfcl-eval` wheel,
installed `--no-deps` (requirements/nodeps.txt); only its light submodules are
imported here (`constants.executable_backend_config`, the simulator classes in
`eval_checker.multi_turn_eval.func_source_code`, and the official
`multi_turn_checker`), whose one third-party import is `mpmath`.

Episode protocol (BFCL tasks have several user turns):

* `Task.messages` holds the system prompt and the first user turn.
* `step` executes one `ToolCall` on the episode's simulator instances by method
  name (`getattr(instance, name)(**arguments)`, never `eval` of model text) and
  returns the result formatted as the official executor does.
* When the model gives a final answer, the current user turn is over: the agent
  loop calls `next_turn(state, final_answer)`, which returns the next user
  message(s) to append (or None when the task has no more turns). This mirrors
  BFCL's inference loop, where a response without function calls ends a turn.
  In `miss_func` tasks a hold-out turn reveals the missing functions: the
  message carries their docs (BFCL's prompting variant) and `state.data["tools"]`
  gains their schemas.
* `reward` is the official `multi_turn_checker` (state and response checks after
  every turn) on the calls executed per turn, 0 if the episode stopped before
  the last turn (BFCL's "force-terminated") or a call timed out. The checker
  re-executes calls with `eval`; it is only given strings rebuilt here from a
  method name of the involved classes and `repr`s of literal argument values.
"""

from __future__ import annotations

import ast
import copy
import decimal
import importlib
import inspect
import json
import re
import threading
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.records import check_on_bad_row, load_rows

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
ADDITIONAL_FUNCTION_PROMPT = "{functions}\nI have updated some more functions you can choose from. What about now?"
SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a user request and a set of "
    "functions (tools). Make one or more tool calls to fulfil the request. If none of the "
    "functions can be used, or the request lacks parameters a function requires, point it out "
    "instead of guessing.\n\n"
    "The conversation has several user turns. Within a turn, keep calling tools until you have "
    "done everything the user asked for in that turn. Then end the turn with a short reply "
    "inside <answer>...</answer>; the next user message follows."
)
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def _bfcl_module(name: str):
    """Import a light `bfcl_eval` submodule, with install advice when missing."""
    try:
        return importlib.import_module(f"bfcl_eval.{name}")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{err}. bfcl_multi_turn needs the bfcl-eval wheel installed without its "
            "dependencies: pip install --no-deps -r requirements/nodeps.txt"
        ) from err


def bfcl_data_dir() -> Path:
    """The `data/` directory shipped inside the bfcl-eval wheel."""
    return Path(_bfcl_module("constants.executable_backend_config").__file__).parents[1] / "data"


def _read_jsonl(path: Path) -> list[dict]:
    """The rows of a BFCL data file (JSON Lines; `DataError` naming the line of a bad one)."""
    return load_rows(path, lambda n, row: row)


def _entry_id(row: dict) -> str:
    """The row's `id`, of BFCL's form `<category>_<index>` (the train / heldout split reads the index)."""
    value = row["id"]
    if not isinstance(value, str) or not value.rpartition("_")[2].isdigit():
        raise ValueError(f"field 'id' must be a string ending in _<number>, got {value!r:.60}")
    return value


def _check_entry(row: dict, ground_truth: dict[str, list], answer_file: Path) -> dict:
    """A question row with the fields the episodes read, its `ground_truth` added."""
    entry_id = _entry_id(row)
    turns = row["question"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, list) for t in turns):
        raise ValueError("field 'question' must be a non-empty list of turns (lists of messages)")
    if not all(isinstance(m, dict) and "role" in m and "content" in m for t in turns for m in t):
        raise ValueError("field 'question' must hold messages with 'role' and 'content'")
    classes = row["involved_classes"]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError("field 'involved_classes' must be a list of class names")
    if not isinstance(row["initial_config"], dict):
        raise ValueError("field 'initial_config' must be an object")
    if entry_id not in ground_truth:
        raise ValueError(f"no ground truth with id {entry_id!r} in {answer_file}")
    return {**row, "ground_truth": ground_truth[entry_id]}


def _answer(row: dict) -> tuple[str, list]:
    turns = row["ground_truth"]
    if not isinstance(turns, list) or not all(isinstance(t, list) for t in turns):
        raise ValueError("field 'ground_truth' must be a list of turns (lists of call strings)")
    return _entry_id(row), turns


def load_category(category: str, data_dir: Optional[Path] = None, on_bad_row: str = "error") -> list[dict]:
    """Entries of `BFCL_v4_multi_turn_<category>.json`, each with its `ground_truth`.

    A malformed question or answer row raises `DataError` naming its file, line and field
    (`BFCL_v4_multi_turn_base.json:5: missing field 'question'`), or is left out
    (`on_bad_row="skip"`; a question whose answer was left out goes too).
    """
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; valid: {CATEGORIES}")
    root = Path(data_dir) if data_dir is not None else bfcl_data_dir()
    name = f"BFCL_v4_multi_turn_{category}.json"
    answer_file = root / "possible_answer" / name
    answers = dict(load_rows(answer_file, lambda n, row: _answer(row), on_bad_row))
    return load_rows(root / name, lambda n, row: _check_entry(row, answers, answer_file), on_bad_row)


@lru_cache(maxsize=None)
def _class_docs(class_name: str) -> tuple[dict, ...]:
    mapping = _bfcl_module("constants.executable_backend_config").MULTI_TURN_FUNC_DOC_FILE_MAPPING
    return tuple(_read_jsonl(bfcl_data_dir() / "multi_turn_func_doc" / mapping[class_name]))


def _convert_schema(node: Any) -> Any:
    """BFCL's parameter types (dict, float, tuple, any) as JSON-schema types."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "type" and isinstance(value, str):
                mapped = _BFCL_TYPES.get(value, value)
                if mapped is not None:
                    out[key] = mapped
            else:
                out[key] = _convert_schema(value)
        return out
    if isinstance(node, list):
        return [_convert_schema(v) for v in node]
    return node


def openai_tool(doc: dict) -> dict:
    """One BFCL function doc as an OpenAI function-tool schema."""
    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc.get("description", ""),
            "parameters": _convert_schema(doc["parameters"]),
        },
    }


def _entry_docs(entry: dict) -> tuple[list[dict], dict[int, list[dict]]]:
    """(docs visible from turn 0, hold-out docs per turn) as BFCL populates them."""
    docs = [d for c in entry["involved_classes"] for d in _class_docs(c)]
    held: dict[int, list[dict]] = {}
    for turn, names in entry.get("missed_function", {}).items():
        held[int(turn)] = [d for d in docs if d["name"] in names]
        docs = [d for d in docs if d["name"] not in names]
    return docs, held


def _call_string(call: ToolCall) -> Optional[str]:
    """The call as the Python source the official checker executes (None if not expressible).

    Only identifier names and literal-valued arguments are emitted, so the
    checker's `eval` sees nothing but `method(key=<literal>, ...)`.
    """
    if not call.name.isidentifier() or not all(str(k).isidentifier() for k in call.arguments):
        return None
    args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
    try:
        ast.literal_eval(f"[{', '.join(repr(v) for v in call.arguments.values())}]")
    except (ValueError, SyntaxError):
        return None
    return f"{call.name}({args})"


def _format_result(result: Any) -> str:
    """Result formatting of the official executor (`execute_multi_turn_func_call`)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def _run_with_timeout(fn: Callable[[], Any], timeout_s: Optional[float]) -> tuple[bool, Any]:
    """(finished, result-or-exception) of `fn()` run on a daemon thread for at most `timeout_s`.

    A call still running at the deadline is abandoned (Python threads cannot be
    killed); pure-Python loops keep running in the background until they end,
    and a single long C-level operation holds the GIL until it returns.
    """
    if timeout_s is None:
        try:
            return True, fn()
        except Exception as err:  # noqa: BLE001  (tool errors become observations)
            return True, err
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as err:  # noqa: BLE001
            box.append(err)

    thread = threading.Thread(target=target, daemon=True, name="bfcl-call")
    thread.start()
    thread.join(timeout_s)
    return (True, box[0]) if box else (False, None)


def make_instances(entry: dict) -> dict[str, Any]:
    """Fresh simulator instances of the entry's involved classes, loaded from `initial_config`."""
    cfg = _bfcl_module("constants.executable_backend_config")
    long_context = "long_context" in entry["id"] or "composite" in entry["id"]
    instances = {}
    for class_name in entry["involved_classes"]:
        module = importlib.import_module(cfg.CLASS_FILE_PATH_MAPPING[class_name])
        instance = getattr(module, class_name)()
        if class_name not in cfg.STATELESS_CLASSES:
            scenario = copy.deepcopy(entry["initial_config"].get(class_name, {}))
            instance._load_scenario(scenario, long_context=long_context)
        instances[class_name] = instance
    return instances


def method_table(instances: dict[str, Any]) -> dict[str, Any]:
    """Public method name -> bound method (a later class wins a name clash, as in BFCL)."""
    table = {}
    for instance in instances.values():
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
            if not name.startswith("_"):
                table[name] = method
    return table


def parse_call(source: str, methods: dict[str, Any]) -> ToolCall:
    """A ground-truth call string (`f(1, b='x')`) as a keyword-only `ToolCall`."""
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {source!r}")
    name = node.func.id
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    if node.args:
        params = list(inspect.signature(methods[name]).parameters)
        for param, value in zip(params, node.args):
            arguments[param] = ast.literal_eval(value)
    return ToolCall(name=name, arguments=arguments)


@ENVS.register("bfcl_multi_turn")
class BFCLMultiTurnEnv(Env):
    """BFCL v4 multi-turn categories with the official simulators and checker.

    Splits: "test" (or "all") is every entry of the chosen categories (the
    official evaluation set); "train" / "heldout" partition it 80/20 by entry
    index (index % 5 == 0 is held out) for RL runs that keep a held-out part.
    `on_bad_row`: "error" (a malformed data row raises `DataError` naming its file, line and
    field) or "skip" (bad rows are left out, one warning per file).
    """

    name = "bfcl_multi_turn"

    def __init__(
        self,
        categories: tuple[str, ...] | list[str] = CATEGORIES,
        call_timeout_s: Optional[float] = 5.0,
        data_dir: Optional[str] = None,
        max_tasks_per_category: Optional[int] = None,
        on_bad_row: str = "error",
    ) -> None:
        check_on_bad_row(on_bad_row)
        self.on_bad_row = on_bad_row
        self.categories = tuple(categories)
        self.call_timeout_s = call_timeout_s
        self.data_dir = Path(data_dir) if data_dir else None
        self.max_tasks_per_category = max_tasks_per_category
        self._tasks: Optional[list[Task]] = None

    # ---- task set -------------------------------------------------------
    def _build_task(self, entry: dict, category: str) -> Task:
        docs, held = _entry_docs(entry)
        first = [dict(m) for m in entry["question"][0]]
        gold = " | ".join("; ".join(turn) for turn in entry["ground_truth"])
        return Task(
            task_id=entry["id"],
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, *first],
            tools=[openai_tool(d) for d in docs],
            gold_answer=gold,
            meta={"category": category, "entry": entry, "held_out_docs": held},
        )

    def tasks(self, split: str = "test") -> list[Task]:
        if self._tasks is None:
            self._tasks = []
            for category in self.categories:
                entries = load_category(category, self.data_dir, self.on_bad_row)
                if self.max_tasks_per_category is not None:
                    entries = entries[: self.max_tasks_per_category]
                self._tasks += [self._build_task(e, category) for e in entries]
        if split in ("test", "all"):
            return list(self._tasks)
        if split in ("train", "heldout"):
            held = split == "heldout"
            return [t for t in self._tasks if (int(t.task_id.rsplit("_", 1)[1]) % 5 == 0) == held]
        raise ValueError(f"unknown split {split!r}; valid: test, all, train, heldout")

    # ---- episodes -------------------------------------------------------
    def reset(self, task: Task) -> EpisodeState:
        instances = make_instances(task.meta["entry"])
        return EpisodeState(
            task=task,
            data={
                "instances": instances,
                "turn": 0,
                "turn_calls": [[]],
                "tools": list(task.tools),
                "aborted": None,
            },
        )

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        state.history.append(call)
        data = state.data
        if data["aborted"]:
            return f"Error during execution: episode aborted ({data['aborted']})"
        methods = method_table(data["instances"])
        method = methods.get(call.name)
        source = _call_string(call)
        if method is None:
            # What the official executor's eval reports for such a call; it changes no state.
            return f"Error during execution: name '{call.name}' is not defined"
        if source is None:
            return "Error during execution: argument names must be identifiers and values JSON literals"
        data["turn_calls"][data["turn"]].append(source)
        if call.name in ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"):
            return f"Error during execution: Function call {call.name} is not allowed."
        finished, result = _run_with_timeout(lambda: method(**call.arguments), self.call_timeout_s)
        if not finished:
            data["aborted"] = f"{call.name} timed out after {self.call_timeout_s}s"
            return f"Error during execution: {data['aborted']}"
        if isinstance(result, Exception):
            return f"Error during execution: {result}"
        return _format_result(result)

    def next_turn(self, state: EpisodeState, final_answer: Optional[str]) -> Optional[list[dict]]:
        """End the current user turn; the next user message(s), or None after the last turn."""
        data = state.data
        entry = state.task.meta["entry"]
        if data["turn"] + 1 >= len(entry["question"]):
            data["finished"] = True
            return None
        data["turn"] += 1
        data["turn_calls"].append([])
        held = state.task.meta["held_out_docs"].get(data["turn"])
        if held:
            data["tools"] = data["tools"] + [openai_tool(d) for d in held]
            return [
                {"role": "user", "content": ADDITIONAL_FUNCTION_PROMPT.format(functions=json.dumps(held, indent=2))}
            ]
        return [dict(m) for m in entry["question"][data["turn"]]]

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        data = state.data
        entry = state.task.meta["entry"]
        turns = data["turn_calls"]
        if data["aborted"] or len(turns) != len(entry["ground_truth"]):
            return 0.0
        return 1.0 if official_check(entry, turns)["valid"] else 0.0

    def fork(self, state: EpisodeState) -> EpisodeState:
        """Deep-copies the simulators and per-turn records; the task is shared."""
        return EpisodeState(task=state.task, data=copy.deepcopy(state.data), history=list(state.history))


def official_check(entry: dict, turn_calls: list[list[str]]) -> dict:
    """BFCL's `multi_turn_checker` on per-turn call strings (each call its own step).

    The checker re-executes the calls on instances it keeps in its module's
    globals under names derived from the model name; a fresh name per check
    keeps concurrent and repeated checks of one task apart, and the instances
    are dropped afterwards.
    """
    checker = _bfcl_module("eval_checker.multi_turn_eval.multi_turn_checker")
    utils = _bfcl_module("eval_checker.multi_turn_eval.multi_turn_utils")
    model_name = f"trace_mega_{uuid.uuid4().hex}"
    decoded = [[[c] for c in calls] for calls in turn_calls]
    try:
        with decimal.localcontext():  # MathAPI.square_root sets the thread's decimal precision
            return checker.multi_turn_checker(
                decoded, entry["ground_truth"], entry, entry["id"].rsplit("_", 1)[0], model_name
            )
    except Exception as err:  # noqa: BLE001  (e.g. its assertions on mismatched instance sets)
        return {"valid": False, "error_message": f"{type(err).__name__}: {err}"}
    finally:
        for suffix in ("_eval", "_ground_truth_eval"):
            for class_name in entry["involved_classes"]:
                key = re.sub(r"[-./:]", "_", f"{model_name}{suffix}_{entry['id']}_{class_name}_instance")
                vars(utils).pop(key, None)


def ground_truth_calls(task: Task) -> list[list[ToolCall]]:
    """The task's ground-truth call sequence per turn, as keyword `ToolCall`s."""
    methods = method_table(make_instances(task.meta["entry"]))
    return [[parse_call(s, methods) for s in turn] for turn in task.meta["entry"]["ground_truth"]]


def replay(env: BFCLMultiTurnEnv, task: Task, turns: list[list[ToolCall]]) -> float:
    """Run an episode that issues `turns[i]` in user turn i, then score it."""
    state = env.reset(task)
    for i, calls in enumerate(turns):
        for call in calls:
            env.step(state, call)
        if i + 1 < len(turns):
            env.next_turn(state, "done")
    return env.reward(state, "done")


def _altered(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, (list, tuple)):
        return list(value[:-1]) if value else ["x"]
    return {}


def corrupt(turns: list[list[ToolCall]], mode: str) -> list[list[ToolCall]]:
    """A copy of a call sequence with its last call dropped ("drop") or the first argument
    of the last call that has arguments altered ("alter")."""
    turns = copy.deepcopy(turns)
    if mode == "drop":
        last = max(i for i, calls in enumerate(turns) if calls)
        del turns[last][-1]
    elif mode == "alter":
        call = next(c for calls in reversed(turns) for c in reversed(calls) if c.arguments)
        key = next(iter(call.arguments))
        call.arguments[key] = _altered(call.arguments[key])
    else:
        raise ValueError(f"mode must be 'drop' or 'alter', not {mode!r}")
    return turns


def main(argv: Optional[list[str]] = None) -> None:
    """Replay every task's ground truth, and two corruptions of it, per category."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("categories", nargs="*", default=list(CATEGORIES))
    args = parser.parse_args(argv)
    for category in args.categories:
        env = BFCLMultiTurnEnv(categories=(category,))
        tasks = env.tasks("test")
        gold = {t.task_id: ground_truth_calls(t) for t in tasks}
        failed = [t.task_id for t in tasks if replay(env, t, gold[t.task_id]) != 1.0]
        line = f"{category}: ground truth scores 1 on {len(tasks) - len(failed)}/{len(tasks)}"
        for mode in ("drop", "alter"):
            passed = [t.task_id for t in tasks if replay(env, t, corrupt(gold[t.task_id], mode)) != 0.0]
            line += f"; {mode} scores 0 on {len(tasks) - len(passed)}/{len(tasks)} (still 1: {passed})"
        print(line + (f"; ground-truth failures: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
