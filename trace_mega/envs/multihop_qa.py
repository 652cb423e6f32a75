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
from trace_mega.envs.records import as_paths, read_records

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


def load_corpus(path: str | Path) -> list[Passage]:
    """Passages from JSONL with `id`/`title`/`text`, or FlashRAG's `id`/`contents` ("Title"\\ntext)."""
    passages = []
    for n, row in enumerate(read_records(path)):
        if "contents" in row:
            title, _, text = row["contents"].partition("\n")
            title = title.strip().strip('"')
        else:
            title, text = row.get("title", ""), row["text"]
        passages.append(Passage(str(row.get("id", n)), title, text))
    return passages


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
def _task(task_id: str, question: str, answers: Sequence[str], dataset: str, **meta: Any) -> Task:
    answers = [str(a) for a in answers if str(a).strip()]
    if not answers:
        raise ValueError(f"{dataset} question {task_id!r} has no answer")
    return Task(
        task_id=str(task_id),
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        gold_answer=answers[0],
        meta={"dataset": dataset, "answers": answers, **meta},
    )


def _context_passages(context: list) -> list[dict]:
    """HotpotQA / 2Wiki `context` ([title, [sentences]]) as passage dicts."""
    return [{"title": title, "text": " ".join(s.strip() for s in sents)} for title, sents in context]


def load_hotpotqa(path: str | Path) -> list[Task]:
    """HotpotQA: `_id`, `question`, `answer`, `type`, `level`, `supporting_facts`, `context`."""
    return [
        _task(
            r.get("_id", n),
            r["question"],
            [r["answer"]],
            "hotpotqa",
            type=r.get("type"),
            level=r.get("level"),
            supporting_titles=sorted({t for t, _ in r.get("supporting_facts", [])}),
            context=_context_passages(r.get("context", [])),
        )
        for n, r in enumerate(read_records(path))
    ]


def load_2wikimultihopqa(path: str | Path) -> list[Task]:
    """2WikiMultiHopQA: the HotpotQA layout plus `evidences` ([subject, relation, object])."""
    return [
        _task(
            r.get("_id", n),
            r["question"],
            [r["answer"]],
            "2wikimultihopqa",
            type=r.get("type"),
            supporting_titles=sorted({t for t, _ in r.get("supporting_facts", [])}),
            evidences=r.get("evidences", []),
            context=_context_passages(r.get("context", [])),
        )
        for n, r in enumerate(read_records(path))
    ]


def load_musique(path: str | Path) -> list[Task]:
    """MuSiQue JSONL: `id`, `question`, `answer`, `answer_aliases`, `answerable`, `paragraphs`."""
    tasks = []
    for n, r in enumerate(read_records(path)):
        paragraphs = r.get("paragraphs", [])
        tasks.append(
            _task(
                r.get("id", n),
                r["question"],
                [r["answer"], *r.get("answer_aliases", [])],
                "musique",
                answerable=r.get("answerable", True),
                supporting_titles=sorted({p["title"] for p in paragraphs if p.get("is_supporting")}),
                context=[{"title": p["title"], "text": p["paragraph_text"]} for p in paragraphs],
            )
        )
    return tasks


def load_bamboogle(path: str | Path) -> list[Task]:
    """Bamboogle: `Question`, `Answer`."""
    return [
        _task(f"bamboogle-{n}", r["Question"], [r["Answer"]], "bamboogle") for n, r in enumerate(read_records(path))
    ]


def load_flashrag(path: str | Path) -> list[Task]:
    """FlashRAG / Search-R1 layout: `id`, `question`, `golden_answers`; also the shipped
    layout (`question`, `answer`, optional `answer_aliases`, `type`, `supporting_titles`).
    The dataset is the row's `dataset` / `data_source`, else the file name (FlashRAG ships
    one file per benchmark: `nq.jsonl`, `hotpotqa.jsonl`, ...)."""
    tasks = []
    for n, r in enumerate(read_records(path)):
        if "golden_answers" in r:
            answers = r["golden_answers"]
        else:
            answers = [r["answer"], *r.get("answer_aliases", [])]
        extra = {k: r[k] for k in ("type", "supporting_titles") if k in r}
        dataset = r.get("dataset") or r.get("data_source") or Path(path).stem
        tasks.append(_task(r.get("id", n), r["question"], answers, str(dataset), **extra))
    return tasks


LOADERS: dict[str, Callable[[str | Path], list[Task]]] = {
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


def load_qa(path: str | Path, fmt: str = "auto") -> list[Task]:
    """Tasks of a QA file (JSON / JSONL / Parquet); `fmt` is a `LOADERS` name or "auto" (from
    the first row's fields)."""
    if fmt == "auto":
        rows = read_records(path)
        if not rows:
            return []
        fmt = detect_format(rows[0])
    if fmt not in LOADERS:
        raise ValueError(f"unknown QA format {fmt!r}; valid: auto, {', '.join(LOADERS)}")
    return LOADERS[fmt](path)


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
    ) -> None:
        if metric not in ("em", "f1"):
            raise ValueError(f"metric must be 'em' or 'f1', not {metric!r}")
        if retriever not in ("bm25", "e5"):
            raise ValueError(f"retriever must be 'bm25' or 'e5', not {retriever!r}")
        if corpus not in ("file", "context"):
            raise ValueError(f"corpus must be 'file' or 'context', not {corpus!r}")
        shipped = str(DATA / "questions.jsonl")
        self.paths = {"train": as_paths(train_path or shipped), "test": as_paths(test_path or shipped)}
        self.fmt, self.corpus, self.retriever_name = fmt, corpus, retriever
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
            tasks = [t for path in self.paths[split] for t in load_qa(path, self.fmt)]
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
                    passages = load_corpus(self.corpus_path)
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
