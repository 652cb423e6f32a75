"""multihop_qa: shipped data is multi-hop, BM25 search tool, loaders, EM/F1, dense-path errors."""

import json
import sys

import pytest
from whole_token_engine import WholeTokenEngine

from trace_mega.envs import build_env
from trace_mega.envs.base import ToolCall
from trace_mega.envs.multihop_qa import (
    DATA,
    DenseRetriever,
    MultiHopQAEnv,
    Passage,
    corpus_from_tasks,
    detect_format,
    exact_match,
    f1_score,
    load_corpus,
    load_qa,
    normalize_answer,
)


@pytest.fixture(scope="module")
def env():
    return build_env("multihop_qa")


def _by_title():
    return {p.title: p for p in load_corpus(DATA / "corpus.jsonl")}


def test_shipped_data_is_multi_hop_by_construction(env):
    passages = _by_title()
    tasks = env.tasks("train")
    bridges = [t for t in tasks if t.meta["type"] == "bridge"]
    comparisons = [t for t in tasks if t.meta["type"] == "comparison"]
    assert 40 <= len(passages) <= 80 and len(bridges) >= 15 and len(comparisons) >= 5
    for t in bridges:
        question = t.messages[-1]["content"]
        first, second = (passages[s] for s in t.meta["supporting_titles"])
        answer = normalize_answer(t.gold_answer)
        assert second.title.lower() in first.text.lower(), t.task_id  # the bridge entity
        assert second.title.lower() not in question.lower(), t.task_id  # ... is not named
        assert answer not in normalize_answer(first.text), t.task_id  # first hop lacks it
        assert answer in normalize_answer(second.text), t.task_id  # second hop has it
    for t in comparisons:
        a, b = (passages[s] for s in t.meta["supporting_titles"])
        assert a.title.split()[-1] in t.messages[-1]["content"] and b.title.split()[-1] in t.messages[-1]["content"]


def test_search_finds_each_hop(env):
    passages = _by_title()
    for t in env.tasks():
        first, second = t.meta["supporting_titles"]
        hits = [p.title for p, _ in env.retriever.search(t.messages[-1]["content"], 3)]
        assert first in hits or t.meta["type"] == "comparison" and second in hits, (t.task_id, hits)
        assert second in [p.title for p, _ in env.retriever.search(passages[second].title, 3)]


def test_search_tool_observation(env):
    state = env.reset(env.tasks()[0])
    obs = env.step(state, ToolCall("search", {"query": "Halvard lamp", "k": 2}))
    lines = obs.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1] Halvard lamp: ")
    assert "Oskar Brenn" in lines[0]
    assert env.step(state, ToolCall("search", {"query": "the of and"})) == "No passages found."
    assert "non-empty" in env.step(state, ToolCall("search", {"query": ""}))
    assert "positive integer" in env.step(state, ToolCall("search", {"query": "x", "k": 0}))
    assert "unknown tool" in env.step(state, ToolCall("lookup", {"query": "x"}))
    many = env.step(state, ToolCall("search", {"query": "river town province city", "k": 50}))
    assert len(many.splitlines()) <= env.max_k
    short = MultiHopQAEnv(passage_chars=40)
    first = short.step(short.reset(short.tasks()[0]), ToolCall("search", {"query": "Halvard lamp", "k": 1}))
    assert first.endswith("...") and len(first) < 40 + 30
    tool = env.tasks()[0].tools[0]["function"]
    assert tool["name"] == "search" and tool["parameters"]["required"] == ["query"]


def test_reward_em_and_f1(env):
    task = next(t for t in env.tasks() if t.gold_answer == "Grauberg Hills")
    state = env.reset(task)
    assert env.reward(state, "the Grauberg Hills.") == 1.0
    assert env.reward(state, "Grauberg") == 0.0 and env.reward(state, None) == 0.0
    f1 = MultiHopQAEnv(metric="f1")
    assert f1.reward(state, "Grauberg") == pytest.approx(2 / 3)
    alias = next(t for t in env.tasks() if t.gold_answer == "31,200")
    assert env.reward(env.reset(alias), "31200") == 1.0


def test_squad_normalisation_and_metrics():
    assert normalize_answer("The  Quick, Brown fox!") == "quick brown fox"
    assert exact_match("an apple", ["Apple"]) == 1.0 and exact_match("apples", ["apple"]) == 0.0
    assert f1_score("quick brown dog", ["the quick brown fox"]) == pytest.approx(2 / 3)
    assert f1_score("x", ["y", "x z"]) == pytest.approx(2 / 3) and f1_score("", ["a"]) == 0.0


def _write(path, rows, jsonl=True):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if jsonl else json.dumps(rows))
    return str(path)


def test_hotpotqa_and_2wiki_loaders(tmp_path):
    context = [["Alpha", ["Alpha is a town.", " It lies on the Beta."]], ["Beta", ["Beta is a river."]]]
    hotpot = _write(
        tmp_path / "hotpot.json",
        [
            {
                "_id": "5a8b",
                "question": "Which river?",
                "answer": "Beta",
                "type": "bridge",
                "level": "hard",
                "supporting_facts": [["Alpha", 1], ["Beta", 0]],
                "context": context,
            }
        ],
        jsonl=False,
    )
    (t,) = load_qa(hotpot)
    assert (t.task_id, t.gold_answer, t.meta["dataset"], t.meta["level"]) == ("5a8b", "Beta", "hotpotqa", "hard")
    assert t.meta["supporting_titles"] == ["Alpha", "Beta"]
    assert t.meta["context"][0] == {"title": "Alpha", "text": "Alpha is a town. It lies on the Beta."}
    wiki = _write(
        tmp_path / "2wiki.json",
        [
            {
                "_id": "w1",
                "question": "Who?",
                "answer": "Gamma",
                "type": "compositional",
                "supporting_facts": [["Alpha", 0]],
                "context": context,
                "evidences": [["Alpha", "river", "Beta"]],
            }
        ],
        jsonl=False,
    )
    (w,) = load_qa(wiki)
    assert w.meta["dataset"] == "2wikimultihopqa" and w.meta["evidences"] == [["Alpha", "river", "Beta"]]
    corpus = corpus_from_tasks([t, w])
    assert sorted(p.title for p in corpus) == ["Alpha", "Beta"]


def test_musique_bamboogle_flashrag_loaders(tmp_path):
    musique = _write(
        tmp_path / "musique.jsonl",
        [
            {
                "id": "2hop__1",
                "question": "Q?",
                "answer": "Delta",
                "answer_aliases": ["D."],
                "answerable": True,
                "paragraphs": [
                    {"idx": 0, "title": "T0", "paragraph_text": "Delta text", "is_supporting": True},
                    {"idx": 1, "title": "T1", "paragraph_text": "noise", "is_supporting": False},
                ],
            }
        ],
    )
    (m,) = load_qa(musique)
    assert m.meta["answers"] == ["Delta", "D."] and m.meta["supporting_titles"] == ["T0"]
    state_env = MultiHopQAEnv(train_path=musique, corpus="context")
    state = state_env.reset(state_env.tasks("train")[0])
    assert state_env.reward(state, "d") == 1.0
    assert "Delta text" in state_env.step(state, ToolCall("search", {"query": "delta"}))
    bamboo = _write(tmp_path / "bamboogle.json", [{"Question": "Who?", "Answer": "Epsilon"}], jsonl=False)
    (b,) = load_qa(bamboo)
    assert (b.task_id, b.gold_answer, b.meta["dataset"]) == ("bamboogle-0", "Epsilon", "bamboogle")
    flash = _write(tmp_path / "nq.jsonl", [{"id": "test_0", "question": "q", "golden_answers": ["x", "y"]}])
    assert load_qa(flash)[0].meta["answers"] == ["x", "y"]
    with pytest.raises(ValueError, match="unrecognised"):
        detect_format({"prompt": "x"})
    with pytest.raises(ValueError, match="no answer"):
        load_qa(_write(tmp_path / "empty.jsonl", [{"question": "q", "golden_answers": []}]))


def test_flashrag_corpus_layout(tmp_path):
    path = _write(tmp_path / "wiki.jsonl", [{"id": "0", "contents": '"Zeta"\nZeta is a letter.'}])
    assert load_corpus(path) == [Passage("0", "Zeta", "Zeta is a letter.")]


def test_dense_retrieval_fails_clearly_without_its_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match="faiss"):
        DenseRetriever([Passage("0", "a", "b")])
    env = MultiHopQAEnv(retriever="e5")
    with pytest.raises(ImportError, match="faiss"):
        env.step(env.reset(env.tasks()[0]), ToolCall("search", {"query": "x"}))


def test_bad_options():
    for kwargs in ({"metric": "bleu"}, {"retriever": "tfidf"}, {"corpus": "web"}):
        with pytest.raises(ValueError):
            MultiHopQAEnv(**kwargs)
    with pytest.raises(ValueError, match="unknown QA format"):
        load_qa(str(DATA / "questions.jsonl"), "squad")


def test_dense_retriever_pipeline_with_a_tiny_local_encoder(tmp_path):
    """E5-style pooling + FAISS search end to end on CPU with a random tiny BERT (runs where
    faiss is installed, e.g. with the gpu extra; the retrieval quality of E5 is not tested)."""
    pytest.importorskip("faiss")
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    passages = load_corpus(DATA / "corpus.jsonl")
    words = {w.strip(".,:;()'\"").lower() for p in passages for w in f"{p.title} {p.text}".split()}
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", *sorted(w for w in words if w)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    ).save_pretrained(tmp_path)
    retriever = DenseRetriever(passages, model=str(tmp_path), device="cpu")
    hits = retriever.search("Halvard lamp", 5)
    scores = [s for _, s in hits]
    assert len(hits) == 5 and scores == sorted(scores, reverse=True)
    assert all(-1.0001 <= s <= 1.0001 for s in scores) and {p for p, _ in hits} <= set(passages)


def test_two_hop_episode_through_the_agent_loop(env):
    """Search the bridge entity, then the answer's passage, then answer: reward 1."""
    from trace_mega.config import RolloutConfig
    from trace_mega.envs.tokenizer import build_tiny_tokenizer
    from trace_mega.rollout.agent_loop import AgentLoop

    task = next(t for t in env.tasks() if t.gold_answer == "Vallis")
    actions = [
        '<tool_call>{"name": "search", "arguments": {"query": "architect of the Gannet Light"}}</tool_call>',
        '<tool_call>{"name": "search", "arguments": {"query": "Tomas Ferreira born", "k": 1}}</tool_call>',
        "<answer>Vallis</answer>",
    ]
    tok = build_tiny_tokenizer([], actions)
    loop = AgentLoop(
        env,
        WholeTokenEngine(tok, actions),
        tok,
        RolloutConfig(max_turns=5, max_new_tokens_per_turn=4, max_total_tokens=8192),
    )
    (tree,) = loop.rollout([task], [1])
    loop.close()
    first, second, final = (tree.nodes[n] for n in tree.path(tree.leaves()[0])[1:])
    assert "Tomas Ferreira" in first.observation and "Vallis" not in first.observation.split("[2]")[0]
    assert second.observation.startswith("[1] Tomas Ferreira:") and "Vallis" in second.observation
    assert final.reward == 1.0


def test_parquet_and_several_benchmark_files(tmp_path):
    """FlashRAG rows in Parquet; one file per benchmark, each task tagged with its dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    nq = tmp_path / "nq.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "test_0", "question": "q?", "golden_answers": ["a", "b"]}]), nq)
    (t,) = load_qa(str(nq))
    assert (t.meta["dataset"], t.meta["answers"]) == ("nq", ["a", "b"])
    bamboo = _write(tmp_path / "bamboogle.json", [{"Question": "Who?", "Answer": "E"}], jsonl=False)
    env = MultiHopQAEnv(test_path=[str(nq), bamboo])
    assert [x.meta["dataset"] for x in env.tasks("test")] == ["nq", "bamboogle"]
    assert all(x.tools[0]["function"]["name"] == "search" for x in env.tasks("test"))


# ---- malformed data: one line naming the place, or skipped and counted ----------------
def test_bad_rows_name_file_line_or_row_and_field(tmp_path):
    from trace_mega.envs.records import DataError

    good = {"question": "q", "answer": "a"}
    jsonl = tmp_path / "nq.jsonl"
    jsonl.write_text(json.dumps(good) + "\n\n{bad json\n")
    with pytest.raises(DataError) as err:
        load_qa(jsonl)
    assert str(err.value) == f"{jsonl}:3: invalid JSON (Expecting property name enclosed in double quotes: column 2)"
    hotpot = _write(
        tmp_path / "hotpot.json",
        [{**good, "context": [], "supporting_facts": []}, {"question": "q2", "context": [], "supporting_facts": []}],
        jsonl=False,
    )
    with pytest.raises(DataError, match=r"^.*hotpot\.json row 1: missing field 'answer'$"):
        load_qa(hotpot)
    with pytest.raises(DataError, match=r"hotpot\.json row 0: field 'context' must be a list of \[title"):
        load_qa(_write(tmp_path / "hotpot.json", [{**good, "context": "x", "supporting_facts": []}], jsonl=False))
    with pytest.raises(DataError, match=r"empty\.jsonl:1: no answer: field 'golden_answers' is empty$"):
        load_qa(_write(tmp_path / "empty.jsonl", [{"question": "q", "golden_answers": [None, ""]}]))
    with pytest.raises(DataError, match=r"rows\.json row 1: not a JSON object \(got list\)"):
        load_qa(_write(tmp_path / "rows.json", [good, ["q", "a"]], jsonl=False), "flashrag")
    with pytest.raises(DataError, match=r"odd\.jsonl:1: unrecognised multi-hop QA row with fields \['prompt'\]"):
        load_qa(_write(tmp_path / "odd.jsonl", [{"prompt": "x"}]))
    corpus = _write(tmp_path / "corpus.jsonl", [{"id": "0", "title": "A", "text": "a"}, {"id": "1", "title": "B"}])
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: missing field 'text'$"):
        load_corpus(corpus)


def test_bad_parquet_rows_and_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trace_mega.envs.records import DataError

    path = tmp_path / "nq.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}, {"question": None, "answer": "b"}]), path)
    with pytest.raises(DataError, match=r"nq\.parquet row 1: field 'question' must be a non-empty string, got None$"):
        load_qa(path)
    assert [t.gold_answer for t in load_qa(path, on_bad_row="skip")] == ["a"]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match=r"broken\.parquet: unreadable Parquet file"):
        load_qa(broken, on_bad_row="skip")  # a file that cannot be read at all is never skipped


def test_on_bad_row_skip_counts_and_warns_once_per_file(tmp_path, caplog):
    questions = tmp_path / "qs.jsonl"
    rows = [{"question": "q0", "answer": "a0"}, {"question": "q1"}, {"question": "q2", "answer": "a2"}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    corpus = _write(tmp_path / "corpus.jsonl", [{"title": "A", "text": "alpha"}, {"title": "B"}])
    env = build_env("multihop_qa", train_path=str(questions), corpus_path=corpus, on_bad_row="skip")
    with caplog.at_level("WARNING", logger="trace_mega.envs.records"):
        tasks = env.tasks("train")
        env.retriever  # noqa: B018  (loads the corpus)
    assert [t.gold_answer for t in tasks] == ["a0", "a2"] and [t.task_id for t in tasks] == ["0", "2"]
    assert [p.text for p in env.retriever.passages] == ["alpha"]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"{questions}: skipped 2 bad row(s) of 4 (on_bad_row: skip); the first: {questions}:2: missing field 'answer'",
        f"{corpus}: skipped 1 bad row(s) of 2 (on_bad_row: skip); the first: {corpus}:2: missing field 'text'",
    ]
    with pytest.raises(ValueError, match="on_bad_row must be one of error, skip, not 'ignore'"):
        build_env("multihop_qa", on_bad_row="ignore")


@pytest.mark.parametrize(
    "fmt, row, problem",
    [
        ("hotpotqa", {"question": "q", "context": [], "supporting_facts": [["A"]]}, "missing field 'answer'"),
        ("2wikimultihopqa", {"question": "q", "answer": "a", "evidences": "x"}, "field 'evidences' must be a list"),
        ("musique", {"question": "q", "answer": "a", "paragraphs": [{"title": "T"}]}, "field 'paragraphs' must hold"),
        ("bamboogle", {"Question": "q"}, "missing field 'Answer'"),
        ("flashrag", {"question": 7, "answer": "a"}, "field 'question' must be a non-empty string, got 7"),
    ],
)
def test_every_qa_loader_names_the_bad_row(tmp_path, fmt, row, problem):
    from trace_mega.envs.records import DataError

    path = _write(
        tmp_path / f"{fmt}.json", [{"question": "ok", "answer": "a", "Question": "ok", "Answer": "a"}, row], False
    )
    with pytest.raises(DataError) as err:
        load_qa(path, fmt)
    assert str(err.value).startswith(f"{path} row 1: {problem}")
    assert len(load_qa(path, fmt, on_bad_row="skip")) == 1
