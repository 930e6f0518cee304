"""lm-evaluation-harness scores a multiple-choice task through the server (`local-completions`: echo +
logprobs, the server's own tokenizer via /tokenizer_info) exactly as its `hf` model scores the same checkpoint
in transformers: the same loglikelihood per choice and the same accuracy. The task is a local JSONL file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency: pip install -e '.[test]'")

DATA = Path(__file__).parent / "fixtures" / "lm_eval" / "capitals.jsonl"
TASK = "pagedserve_capitals"


def write_task(folder: Path) -> Path:
    config = {
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA)}},
        "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / f"{TASK}.yaml").write_text(json.dumps(config))     # JSON is YAML
    return folder


def evaluate(model: str, model_args: dict, task_dir: Path) -> tuple[float, list[list[float]]]:
    from lm_eval.tasks import TaskManager
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                      bootstrap_iters=0, random_seed=0)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return results["results"][TASK]["acc,none"], loglikelihoods


def test_lm_eval_through_the_server_equals_lm_eval_on_transformers(server, tiny_checkpoint, tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task_dir = write_task(tmp_path)
    served_acc, served = evaluate("local-completions", {
        "base_url": f"{server.base_url}/v1/completions", "model": MODEL_NAME, "tokenizer_backend": "remote",
        "num_concurrent": 2, "max_retries": 1}, task_dir)
    hf_acc, reference = evaluate("hf", {"pretrained": str(tiny_checkpoint), "dtype": "float32", "device": "cpu"},
                                 task_dir)
    assert len(served) == len(reference) == 4 and all(len(row) == 4 for row in served)
    for ours, theirs in zip(served, reference):
        assert ours == pytest.approx(theirs, abs=1e-3)
    assert served_acc == hf_acc
