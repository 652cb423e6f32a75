"""Multi-hop question answering with a local search tool (`multihop_qa`).

The `search(query, k)` tool returns the top-k passages of a local corpus,
each truncated, ranked by BM25 (`bm25s`) or, optionally on a GPU, by dense
E5 embeddings searched with FAISS (lazy imports; see `DenseRetriever`).
Rewards are SQuAD-normalised exact match (default, binary) or token F1 of the
final answer against the gold answer and its aliases.

Loaders map HotpotQA, 2WikiMultiHopQA, MuSiQue, Bamboogle and FlashRAG-style
(`question` / `golden_answers`, as used by Search-R1) files, JSON, JSONL or Parquet, to
`Task`s. Shipped for tests: `trace_mega/data/multihop/corpus.jsonl` (48 short
passages written for the project) and `questions.jsonl` (19 two-hop bridge
questions whose answer sits in a passage reached only through an entity named
in the first one, and 7 comparison questions needing one passage per entity).
"""

from __future__ import annotations

import collections
import re
import string
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from trace_mega.envs.base import ENVS, Env, EpisodeState, Task, ToolCall
from trace_mega.envs.records import DataError, as_paths, check_on_bad_row, load_rows, read_rows, row_error

DATA = Path(__file__).resolve().parents[1] / "data" / "multihop"
SYSTEM_PROMPT = (
    "Answer the question. You can call the `search` tool to look up passages in a local "
    "encyclopedia; questions may need several searches, one per fact (find the entity the "
    "question describes first, then search for that entity). When you know the answer, give "
    "only the short answer (a name, number or phrase) inside <answer>...</answer>."
)


def search_tool(max_k: int) -> dict:
    """The OpenAI function schema of the search tool."""
    return {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the local encyclopedia and return the top-k passages, each with its title.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to search for."},
                    "k": {
                        "type": "integer",
                        "description": f"How many passages (1-{max_k}).",
                        "minimum": 1,
                        "maximum": max_k,
                    },
                },
                "required": ["query"],
            },
        },
    }


# ---- answers ------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Best SQuAD token F1 of the prediction over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(ref)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---- corpus and retrieval -------------------------------------------------------
@dataclass(frozen=True)
class Passage:
    """One retrievable passage."""

    id: str
    title: str
    text: str


def _passage(n: int, row: dict[str, Any]) -> Passage:
    if "contents" in row:
        title, _, text = _text(row, "contents").partition("\n")
        title = title.strip().strip('"')
    else:
        title, text = str(row.get("title") or ""), _text(row, "text")
    return Passage(str(row.get("id", n)), title, text)


def load_corpus(path: str | Path, on_bad_row: str = "error") -> list[Passage]:
    """Passages from JSONL with `id`/`title`/`text`, or FlashRAG's `id`/`contents` ("Title"\\ntext).
    A bad row raises `DataError` naming its place, or is skipped (`on_bad_row`, `records.load_rows`)."""
    return load_rows(path, _passage, on_bad_row)


class BM25Retriever:
    """BM25 over passages (title + text) with `bm25s`, English stop words removed."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        import bm25s

        self._bm25s = bm25s
        self.passages = list(passages)
        tokens = bm25s.tokenize([f"{p.title}. {p.text}" for p in self.passages], stopwords="en", show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(tokens, show_progress=False)
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """The top-`k` passages and their scores, best first."""
        k = max(1, min(k, len(self.passages)))
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        with self._lock:
            docs, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(self.passages[int(i)], float(s)) for i, s in zip(docs[0], scores[0]) if s > 0]


class DenseRetriever:
    """E5 embeddings (mean-pooled, normalised, "query:"/"passage:" prefixes) in a FAISS
    inner-product index; the GPU path. Needs CUDA and `faiss` (the project's `gpu` extra).
    """

    def __init__(
        self,
        passages: Sequence[Passage],
        model: str = "intfloat/e5-base-v2",
        batch_size: int = 128,
        device: str = "cuda",
    ) -> None:
        try:
            import faiss
        except ImportError as err:
            raise ImportError("dense retrieval needs faiss: pip install 'trace-mega[gpu]' (faiss-gpu-cu12)") from err
        import torch
        from transformers import AutoModel, AutoTokenizer

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(
                "dense retrieval (E5 + FAISS) is the GPU path and needs CUDA; use retriever='bm25' on CPU"
            )
        self.torch, self.device, self.batch_size = torch, device, batch_size
        self.passages = list(passages)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self.model = AutoModel.from_pretrained(model, dtype=dtype).to(device).eval()
        vectors = self._encode([f"passage: {p.title}. {p.text}" for p in self.passages])
        index = faiss.IndexFlatIP(vectors.shape[1])
        self._gpu_resources = None  # must outlive the GPU index
        if hasattr(faiss, "StandardGpuResources") and device.startswith("cuda"):
            self._gpu_resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        index.add(vectors)
        self.index = index
        self._lock = threading.Lock()

    def _encode(self, texts: list[str]):
        out = []
        with self.torch.inference_mode():
            for at in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[at : at + self.batch_size], padding=True, truncation=True, max_length=512, return_tensors="pt"
                ).to(self.device)
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1)
                out.append(self.torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        return self.torch.cat(out).numpy()

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        k = max(1, min(k, len(self.passages)))
        with self._lock:
            scores, ids = self.index.search(self._encode([f"query: {query}"]), k)
        return [(self.passages[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]


# ---- dataset loaders ----------------------------------------------------------
def _text(row: dict[str, Any], key: str) -> str:
    """The row's string field `key` (KeyError when missing, ValueError when not a non-empty string)."""
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {key!r} must be a non-empty string, got {value!r:.60}")
    return value


def _list(row: dict[str, Any], key: str) -> list:
    """The row's list field `key`, [] when absent (ValueError when it is something else)."""
    value = row.get(key)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):  # Parquet list columns may come back as tuples
        raise ValueError(f"field {key!r} must be a list, got {type(value).__name__}")
    return list(value)


def _task(task_id: str, question: str, answers: Sequence[Any], dataset: str, answer_field: str, **meta: Any) -> Task:
    answers = [str(a) for a in answers if a is not None and str(a).strip()]
    if not answers:
        raise ValueError(f"no answer: field {answer_field!r} is empty")
    return Task(
        task_id=str(task_id),
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        gold_answer=answers[0],
        meta={"dataset": dataset, "answers": answers, **meta},
    )


def _context_passages(row: dict[str, Any]) -> list[dict]:
    """HotpotQA / 2Wiki `context` ([title, [sentences]]) as passage dicts."""
    try:
        return [
            {"title": str(title), "text": " ".join(s.strip() for s in sents)} for title, sents in _list(row, "context")
        ]
    except (TypeError, ValueError, AttributeError):
        raise ValueError("field 'context' must be a list of [title, [sentences]] pairs") from None


def _supporting_titles(row: dict[str, Any]) -> list[str]:
    try:
        return sorted({str(t) for t, _ in _list(row, "supporting_facts")})
    except (TypeError, ValueError):
        raise ValueError("field 'supporting_facts' must be a list of [title, sentence index] pairs") from None


# Each loader reads its file with `records.load_rows`: a bad row raises `DataError` naming its
# place and field (`data/hotpot.json row 3: missing field 'answer'`), or is skipped and counted
# (`on_bad_row="skip"`).
def load_hotpotqa(path: str | Path, on_bad_row: str = "error") -> list[Task]:
    """HotpotQA: `_id`, `question`, `answer`, `type`, `level`, `supporting_facts`, `context`."""

    def make(n: int, r: dict[str, Any]) -> Task:
        return _task(
            r.get("_id", n),
            _text(r, "question"),
            [r["answer"]],
            "hotpotqa",
            "answer",
            type=r.get("type"),
            level=r.get("level"),
            supporting_titles=_supporting_titles(r),
            context=_context_passages(r),
        )

    return load_rows(path, make, on_bad_row)


def load_2wikimultihopqa(path: str | Path, on_bad_row: str = "error") -> list[Task]:
    """2WikiMultiHopQA: the HotpotQA layout plus `evidences` ([subject, relation, object])."""

    def make(n: int, r: dict[str, Any]) -> Task:
        return _task(
            r.get("_id", n),
            _text(r, "question"),
            [r["answer"]],
            "2wikimultihopqa",
            "answer",
            type=r.get("type"),
            supporting_titles=_supporting_titles(r),
            evidences=_list(r, "evidences"),
            context=_context_passages(r),
        )

    return load_rows(path, make, on_bad_row)


def load_musique(path: str | Path, on_bad_row: str = "error") -> list[Task]:
    """MuSiQue JSONL: `id`, `question`, `answer`, `answer_aliases`, `answerable`, `paragraphs`."""

    def make(n: int, r: dict[str, Any]) -> Task:
        paragraphs = _list(r, "paragraphs")
        try:
            context = [{"title": p["title"], "text": p["paragraph_text"]} for p in paragraphs]
        except (KeyError, TypeError):
            raise ValueError("field 'paragraphs' must hold objects with 'title' and 'paragraph_text'") from None
        return _task(
            r.get("id", n),
            _text(r, "question"),
            [r["answer"], *_list(r, "answer_aliases")],
            "musique",
            "answer",
            answerable=r.get("answerable", True),
            supporting_titles=sorted({p["title"] for p in paragraphs if p.get("is_supporting")}),
            context=context,
        )

    return load_rows(path, make, on_bad_row)


def load_bamboogle(path: str | Path, on_bad_row: str = "error") -> list[Task]:
    """Bamboogle: `Question`, `Answer`."""

    def make(n: int, r: dict[str, Any]) -> Task:
        return _task(f"bamboogle-{n}", _text(r, "Question"), [r["Answer"]], "bamboogle", "Answer")

    return load_rows(path, make, on_bad_row)


def load_flashrag(path: str | Path, on_bad_row: str = "error") -> list[Task]:
    """FlashRAG / Search-R1 layout: `id`, `question`, `golden_answers`; also the shipped
    layout (`question`, `answer`, optional `answer_aliases`, `type`, `supporting_titles`).
    The dataset is the row's `dataset` / `data_source`, else the file name (FlashRAG ships
    one file per benchmark: `nq.jsonl`, `hotpotqa.jsonl`, ...)."""

    def make(n: int, r: dict[str, Any]) -> Task:
        if "golden_answers" in r:
            answers, field = _list(r, "golden_answers"), "golden_answers"
        else:
            answers, field = [r["answer"], *_list(r, "answer_aliases")], "answer"
        extra = {k: r[k] for k in ("type", "supporting_titles") if k in r}
        dataset = r.get("dataset") or r.get("data_source") or Path(path).stem
        return _task(r.get("id", n), _text(r, "question"), answers, str(dataset), field, **extra)

    return load_rows(path, make, on_bad_row)


LOADERS: dict[str, Callable[..., list[Task]]] = {
    "hotpotqa": load_hotpotqa,
    "2wikimultihopqa": load_2wikimultihopqa,
    "musique": load_musique,
    "bamboogle": load_bamboogle,
    "flashrag": load_flashrag,
}


def detect_format(row: dict) -> str:
    """The loader name for a dataset row, from its fields."""
    if "Question" in row and "Answer" in row:
        return "bamboogle"
    if "paragraphs" in row:
        return "musique"
    if "evidences" in row:
        return "2wikimultihopqa"
    if "context" in row and "supporting_facts" in row:
        return "hotpotqa"
    if "question" in row and ("golden_answers" in row or "answer" in row):
        return "flashrag"
    raise ValueError(f"unrecognised multi-hop QA row with fields {sorted(row)}")


def load_qa(path: str | Path, fmt: str = "auto", on_bad_row: str = "error") -> list[Task]:
    """Tasks of a QA file (JSON / JSONL / Parquet); `fmt` is a `LOADERS` name or "auto" (from
    the first row's fields; with `on_bad_row="skip"`, the first row whose layout is known).
    A bad row raises `DataError` naming its place and field, or is skipped (`on_bad_row`)."""
    check_on_bad_row(on_bad_row)
    if fmt == "auto":
        records = read_rows(path)
        if not records:
            return []
        fmt = None
        for rec in records:
            try:
                if rec.error is not None:
                    raise DataError(rec.error)
                fmt = detect_format(rec.row)
                break
            except ValueError as err:
                if on_bad_row == "error":
                    raise row_error(rec.place, err) from None
        # No row of a known layout: every row is bad, and the loader skips and counts them all.
        fmt = fmt or "flashrag"
    if fmt not in LOADERS:
        raise ValueError(f"unknown QA format {fmt!r}; valid: auto, {', '.join(LOADERS)}")
    return LOADERS[fmt](path, on_bad_row)


def corpus_from_tasks(tasks: Sequence[Task]) -> list[Passage]:
    """The distinct context passages of the tasks (HotpotQA-distractor style corpus)."""
    seen: dict[tuple[str, str], Passage] = {}
    for task in tasks:
        for p in task.meta.get("context", []):
            seen.setdefault((p["title"], p["text"]), Passage(f"ctx-{len(seen)}", p["title"], p["text"]))
    return list(seen.values())


# ---- the environment ----------------------------------------------------------
@ENVS.register("multihop_qa")
class MultiHopQAEnv(Env):
    """Search-tool QA over a local corpus.

    Defaults: the shipped corpus and questions (both splits); `train_path` / `test_path`
    may list several files (one per benchmark), each loaded with `fmt`. `corpus_path`:
    a JSONL corpus; `corpus="context"` builds it from the loaded tasks' own
    context paragraphs instead. `metric`: "em" (binary reward) or "f1".
    `on_bad_row`: "error" (a malformed question or corpus row raises `DataError` naming its
    file, line or row, and field) or "skip" (bad rows are left out, one warning per file).
    """

    name = "multihop_qa"

    def __init__(
        self,
        train_path: Optional[str | list[str]] = None,
        test_path: Optional[str | list[str]] = None,
        fmt: str = "auto",
        corpus_path: Optional[str] = None,
        corpus: str = "file",
        retriever: str = "bm25",
        dense_model: str = "intfloat/e5-base-v2",
        top_k: int = 3,
        max_k: int = 10,
        passage_chars: int = 600,
        metric: str = "em",
        on_bad_row: str = "error",
    ) -> None:
        check_on_bad_row(on_bad_row)
        if metric not in ("em", "f1"):
            raise ValueError(f"metric must be 'em' or 'f1', not {metric!r}")
        if retriever not in ("bm25", "e5"):
            raise ValueError(f"retriever must be 'bm25' or 'e5', not {retriever!r}")
        if corpus not in ("file", "context"):
            raise ValueError(f"corpus must be 'file' or 'context', not {corpus!r}")
        shipped = str(DATA / "questions.jsonl")
        self.paths = {"train": as_paths(train_path or shipped), "test": as_paths(test_path or shipped)}
        self.fmt, self.corpus, self.retriever_name, self.on_bad_row = fmt, corpus, retriever, on_bad_row
        self.corpus_path = corpus_path or str(DATA / "corpus.jsonl")
        self.dense_model = dense_model
        self.top_k, self.max_k, self.passage_chars, self.metric = top_k, max_k, passage_chars, metric
        self._tasks: dict[str, list[Task]] = {}
        self._retriever: Any = None
        self._lock = threading.Lock()

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.paths:
            raise ValueError(f"unknown split {split!r}; valid: {sorted(self.paths)}")
        if split not in self._tasks:
            tasks = [t for path in self.paths[split] for t in load_qa(path, self.fmt, self.on_bad_row)]
            for t in tasks:
                t.tools = [search_tool(self.max_k)]
            self._tasks[split] = tasks
        return self._tasks[split]

    @property
    def retriever(self) -> Any:
        """The search index, built on first use (from the corpus file or the tasks' contexts)."""
        with self._lock:
            if self._retriever is None:
                if self.corpus == "context":
                    passages = corpus_from_tasks([t for s in self.paths for t in self.tasks(s)])
                else:
                    passages = load_corpus(self.corpus_path, self.on_bad_row)
                if self.retriever_name == "e5":
                    self._retriever = DenseRetriever(passages, self.dense_model)
                else:
                    self._retriever = BM25Retriever(passages)
            return self._retriever

    def search(self, query: str, k: Optional[int] = None) -> str:
        """The search tool's observation: numbered, titled, truncated passages."""
        hits = self.retriever.search(query, min(k or self.top_k, self.max_k))
        if not hits:
            return "No passages found."
        lines = []
        for n, (p, _) in enumerate(hits, 1):
            text = p.text if len(p.text) <= self.passage_chars else p.text[: self.passage_chars] + "..."
            lines.append(f"[{n}] {p.title}: {text}")
        return "\n".join(lines)

    def step(self, state: EpisodeState, call: ToolCall) -> str:
        state.history.append(call)
        if call.name != "search":
            return f"Error: unknown tool {call.name!r}; the only tool is 'search'."
        query, k = call.arguments.get("query"), call.arguments.get("k", self.top_k)
        if not isinstance(query, str) or not query.strip():
            return "Error: search needs a non-empty string argument 'query'."
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            return f"Error: 'k' must be a positive integer (at most {self.max_k})."
        return self.search(query, k)

    def scores(self, state: EpisodeState, final_answer: Optional[str]) -> dict[str, float]:
        """Exact match and F1 of the final answer."""
        if final_answer is None:
            return {"em": 0.0, "f1": 0.0}
        golds = state.task.meta.get("answers") or [state.task.gold_answer or ""]
        return {"em": exact_match(final_answer, golds), "f1": f1_score(final_answer, golds)}

    def reward(self, state: EpisodeState, final_answer: Optional[str]) -> float:
        return self.scores(state, final_answer)[self.metric]
