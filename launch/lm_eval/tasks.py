"""The local lm-evaluation-harness tasks: documents from a prepared dataset's held-out split.

Nothing is downloaded. The documents of a split are read back from its packed shards (each
(bucket, source) stream of blocks in key order, cut at </s>, the tail without one dropped) and
decoded with the dataset's tokenizer. Each task is a jsonl file of docs plus an lm-eval task
config (the dict form of its YAML) that reads it through the `json` loader of `datasets`:

    cloze   the last word of a document from the words before it; acc (the word is the greedy
            continuation) and perplexity, as lm-eval's lambada_openai scores them
    choice  a document's ending (its second half, at most ENDING_WORDS words) among 3 distractors,
            endings of other documents of the split drawn with `seed`; acc and acc_norm, as
            hellaswag scores them

A document whose target or ending takes more than half the model's positions is left out
(`score`), so that every request fits with context to spare.
"""

from __future__ import annotations

import json
import random
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

from common.configure import UserError
from common.hashing import file_sha256
from pipeline import remote
from pipeline.format import (
    dataset_specials,
    dataset_tokenizer,
    decode_array,
    read_manifest,
    shard_entries,
)

TASKS = ("cloze", "choice")
DISTRACTORS = 3
ENDING_WORDS = 12  # a choice ending's most words: a sentence's worth, as hellaswag's endings


def check_tasks(names) -> list[str]:
    """The task names as a list; UserError naming the first one that is not ours."""
    names = list(names)
    if not names:
        raise UserError(f"tasks: none given; choose from {', '.join(TASKS)}")
    for name in names:
        if name not in TASKS:
            raise UserError(f"tasks: {name!r} is not one of {', '.join(TASKS)}")
    return names


def training_problem(every: int, tasks, split: str) -> str | None:
    """What stops a training run from scoring `lm_eval.every` steps (lm-eval missing, a task or
    split not ours), one line naming its key; None if nothing does. Asked by the resolution route
    (`launch.resolve.resolve`) of a causal_lm run with lm_eval.every set."""
    import importlib.util

    if not every:
        return None
    if importlib.util.find_spec("lm_eval") is None:
        return "lm_eval.every: needs lm-eval (pip install -e '.[hf]')"
    if split not in ("valid", "test"):
        return f"lm_eval.split: {split!r} is not valid or test"
    try:
        check_tasks(tasks)
    except UserError as err:
        return f"lm_eval.{err}"
    return None


def held_out_texts(
    data_dir: str | Path, split: str, tokenizer_sha256: str | None = None
) -> list[str]:
    """The documents of a split's packed shards as text, in manifest order; the dataset's
    tokenizer must be the model's (`tokenizer_sha256`, when given)."""
    data_dir = data_dir if remote.is_url(data_dir) else Path(data_dir)
    manifest = read_manifest(data_dir)
    data_sha = manifest["tokenizer"]["sha256"]
    if tokenizer_sha256 and data_sha != tokenizer_sha256:
        raise UserError(
            f"tokenizer mismatch: the model was trained with tokenizer {tokenizer_sha256[:12]}, "
            f"{data_dir} was prepared with {data_sha[:12]}; score on data "
            "prepared with the model's tokenizer"
        )
    streams: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
    for entry in shard_entries(manifest, "causal_lm", split):
        path = Path(
            remote.local_file(
                remote.join(data_dir, entry["path"]),
                size=entry.get("bytes"),
                sha256=entry.get("sha256"),
            )
        )
        if not path.is_file() or (entry.get("sha256") and file_sha256(path) != entry["sha256"]):
            raise UserError(f"{path}: missing or not the shard the manifest lists (sha256 differs)")
        # One stream per (source folder, bucket): prepare packs each one apart, shard after shard.
        stream = entry["path"].rsplit("-", 1)[0]
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".input_ids.npy"):
                    key = member.name.split(".", 1)[0]
                    streams[stream].append(
                        (key, decode_array(tar.extractfile(member).read()).tolist())
                    )
    tokenizer = dataset_tokenizer(data_dir, manifest)
    end = dataset_specials(manifest).document_end
    texts = []
    for blocks in streams.values():
        ids = [token for _, block in sorted(blocks) for token in block]
        document: list[int] = []
        for token in ids:  # what follows the last document's end is a cut document: left out
            if token == end:
                text = tokenizer.decode(document).strip()
                if text:
                    texts.append(text)
                document = []
            else:
                document.append(token)
    if not texts:
        raise UserError(f"{data_dir}: the {split} split has no whole document to build tasks from")
    return texts


def cloze_docs(texts: list[str], fits: Callable[[str], bool]) -> list[dict]:
    """{context, target}: a document less its last word, and " " + that word (when it `fits`)."""
    docs = []
    for text in texts:
        words = text.split()
        if len(words) >= 2 and fits(" " + words[-1]):
            docs.append({"context": " ".join(words[:-1]), "target": " " + words[-1]})
    return docs


def choice_docs(texts: list[str], seed: int, fits: Callable[[str], bool]) -> list[dict]:
    """{context, choices, label}: a document less its ending (its second half, at most
    ENDING_WORDS words), and that ending among DISTRACTORS endings of other documents (all
    different, each one that `fits`), in a seeded order."""
    halves = []
    for text in texts:
        words = text.split()
        if len(words) >= 2:
            cut = len(words) - min(len(words) // 2, ENDING_WORDS)
            ending = " ".join(words[cut:])
            if fits(" " + ending):
                halves.append((" ".join(words[:cut]), ending))
    endings = sorted({ending for _, ending in halves})
    if len(endings) <= DISTRACTORS:
        raise UserError(
            f"choice: the split has {len(endings)} different document endings; "
            f"a multiple-choice task needs more than {DISTRACTORS}"
        )
    rng = random.Random(seed)
    docs = []
    for context, ending in halves:
        others = rng.sample([other for other in endings if other != ending], DISTRACTORS)
        label = rng.randrange(DISTRACTORS + 1)
        docs.append(
            {
                "context": context,
                "choices": others[:label] + [ending] + others[label:],
                "label": label,
            }
        )
    return docs


def build_docs(
    texts: list[str], seed: int, fits: Callable[[str], bool] = lambda continuation: True
) -> dict:
    """Both tasks' docs; `fits(continuation)`: whether a target or ending is short enough to score
    (lm-eval refuses a continuation longer than the model's positions)."""
    return {"cloze": cloze_docs(texts, fits), "choice": choice_docs(texts, seed, fits)}


def write_task_configs(
    names: list[str], docs: dict[str, list[dict]], directory: Path
) -> list[dict]:
    """Each task's docs as DIRECTORY/NAME.jsonl and its lm-eval task config reading them."""
    directory.mkdir(parents=True, exist_ok=True)
    configs = []
    for name in names:
        path = directory / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs[name]),
            encoding="utf-8",
        )
        configs.append(task_config(name, path, directory / "cache"))
    return configs


def task_config(name: str, data_file: Path, cache_dir: Path) -> dict:
    """The lm-eval TaskConfig (as its YAML would read) of task `name` over the jsonl `data_file`."""
    common = {
        "task": name,
        "dataset_path": "json",
        "test_split": "test",
        "num_fewshot": 0,
        # The packaged json loader reads the file; its Arrow cache stays beside it.
        "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(cache_dir)},
        "doc_to_text": "context",
        "metadata": {"version": 1.0},
    }
    if name == "cloze":
        return {
            **common,
            "output_type": "loglikelihood",
            "doc_to_target": "target",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            ],
        }
    return {
        **common,
        "output_type": "multiple_choice",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
