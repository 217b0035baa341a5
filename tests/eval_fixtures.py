"""Local benchmark data for tests: a few rows per offline benchmark, so that no test reads data that an earlier
command (`attnres eval prepare-data`, `make demo`) left in the project cache."""

from attnres_hf.eval import data


def offline_fixture_rows() -> dict[str, dict[str, list[dict]]]:
    """A few rows per offline benchmark, in the columns `prepare_offline` writes."""
    mmlu = [{"question": f"Question {i} about {s}?", "subject": s, "choices": ["one", "two", "three", "four"],
             "answer": i % 4} for s in ("anatomy", "virology") for i in range(6)]
    arc = [{"id": f"q{i}", "question": f"Which is item {i}?", "answerKey": "ABCD"[i % 4],
            "choices": {"text": ["red", "green", "blue", "gray"], "label": list("ABCD")}} for i in range(4)]
    return {
        "mmlu": {"test": data.round_robin(mmlu[:3] + mmlu[6:9], "subject"), "dev": mmlu[3:6] + mmlu[9:]},
        "arc_challenge": {"test": arc, "validation": arc},
        "arc_easy": {"test": arc, "validation": arc},
        "hellaswag": {"validation": [{"ind": i, "activity_label": "Cooking", "ctx_a": f"A man cuts {i} onions.",
                                      "ctx_b": "he", "ctx": f"A man cuts {i} onions. he",
                                      "endings": ["fries them.", "sings [title] loudly.", "sleeps.", "runs."],
                                      "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"}
                                     for i in range(3)]},
        "gsm8k": {"test": [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
                           for i in range(7)]},
        "math500": {"test": [{"problem": f"Compute ${i}+1$.", "solution": f"It is $\\boxed{{{i + 1}}}$.",
                              "answer": str(i + 1), "level": 1, "unique_id": f"t/{i}"} for i in range(6)]},
        "mbpp": {"test": [{"task_id": i, "text": "Write a function add(a, b) returning a + b.",
                           "code": "def add(a, b):\n    return a + b", "test_setup_code": "",
                           "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
                           "challenge_test_list": []} for i in range(5)]},
        "triviaqa": {"validation": [{"question": f"Capital number {i}", "question_id": f"t{i}",
                                     "answer": {"aliases": ["Paris"], "normalized_aliases": ["paris"], "value": "Paris"}}
                                    for i in range(3)]},
        "lambada": {"test": [{"text": f"She opened the door and saw the {w}"} for w in ("cat", "sea", "garden")]},
        "humaneval": {"test": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
                                "canonical_solution": "    return a + b\n", "entry_point": "add",
                                "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}]},
    }


def write_offline_fixture(folder, names=None):
    """Write `offline_fixture_rows()` (only `names`, when given) as prepared benchmarks under `folder`; returns it."""
    for name, splits in offline_fixture_rows().items():
        if names is None or name in names:
            data.write_benchmark(folder, name, splits, force=False)
    return folder
