"""Shared test data: a tiny synthetic English->German corpus made in the test, and a prepared dataset of it."""

import fcntl
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# The helper modules that test files share assert as tests do: pytest rewrites their asserts too,
# so that a failure shows the values compared, as it did while they were part of test files.
pytest.register_assert_rewrite(
    "batches",
    "clirun",
    "dryrun",
    "errorlines",
    "madecheckpoints",
    "processes",
    "sourcecfg",
    "trainruns",
    "warm_start_sources",
)

# The suite runs on the CPU wherever it runs, so that its figures (exact loss equalities, gloo)
# mean the same on a GPU machine as in CI, and a 1-GPU machine can run its 2-rank jobs. CUDA is
# initialised here first, so the `gpu` tests of this process still see the GPUs; those that
# start processes of their own give them GPU_ENV, the environment as it was.
GPU_ENV = dict(os.environ)
HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA:
    torch.cuda.init()
    # Counted now, while the GPUs are visible: torch caches the count once CUDA is initialised,
    # and counts again from CUDA_VISIBLE_DEVICES before (0 after the line below: every
    # get_device_properties, and inductor's device checks, would then fail "Invalid device id").
    assert torch.cuda.device_count() > 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Inductor compiles in this process, not in workers started with the GPUs hidden.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# The costliest test files, run first: `make test` deals whole files to the xdist workers in
# collection order (--no-loadscope-reorder; xdist's own order puts the files with the most tests
# first, which left the SLURM, main-job and training files, few tests each, for the end, where one
# worker ran them alone). Longest first keeps the last files short, so the workers end together.
# A file not listed runs after these in its usual order; the list only orders, it selects nothing.
# Seconds of one worker (setup + call + teardown) in `make test` less the SLURM file at aef99cf
# on the 2-core EPYC, while another suite and benchmarks shared the cores (load ~6): about 3x
# what CI's own run takes; the order is what counts. A shared fixture's build (tiny_dataset,
# hf_layout_data) is counted in the file that asked first.
COSTLIEST_FIRST = [
    "slurm/test_slurm.py",  # 223 at bbd1fb5, mostly waiting on SLURM: the others have the cores
    "launch/test_main.py",  # 776
    "pipeline/test_prepare.py",  # 654
    "launch/test_elastic.py",  # 652
    "launch/test_reliability.py",  # 469
    "launch/test_train.py",  # 365
    "launch/test_gpu_path.py",  # 315
    "launch/test_bad_inputs.py",  # 305
    "launch/test_compile.py",  # 279
    "pipeline/test_progress.py",  # 259
    "test_cli.py",  # 238
    "launch/test_checkpoint_save.py",  # 226
    "launch/test_translation.py",  # 213
    "pipeline/test_remote.py",  # 211
    "launch/test_hf_layouts.py",  # 199
    "launch/test_hf_init.py",  # 195
    "benchmarks/test_gpu.py",  # 187 (its CPU tests)
    "launch/test_offload.py",  # 186
    "launch/test_llama_train.py",  # 136
    "launch/test_preflight.py",  # 123
    "pipeline/test_tokenizer_kinds.py",  # 99
    "test_web_example.py",  # 89
]


def in_cost_order(items) -> list:
    """`items` with the files of COSTLIEST_FIRST first, in its order; tests keep their order in a file."""
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}

    def key(item):
        path = Path(str(item.path)).resolve()
        try:
            name = path.relative_to(ROOT / "tests").as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    return sorted(items, key=key)  # stable


def pytest_collection_modifyitems(config, items):
    """The costliest files first (COSTLIEST_FIRST). `gpu` tests skip without CUDA (they are
    written for a machine the device tool lends). On a machine meant to test the GPU
    (REQUIRE_GPU=1, as benchmarks/gpu_check.sh sets), a torch that cannot use one is an error:
    `pytest -m gpu` would otherwise pass having run nothing."""
    items[:] = in_cost_order(items)
    if HAS_CUDA:
        return
    if os.environ.get("REQUIRE_GPU", "") not in ("", "0") and any(
        "gpu" in item.keywords for item in items
    ):
        why = (
            "this torch is a CPU build"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: no driver, no device "
            "visible (CUDA_VISIBLE_DEVICES), or a driver older than this CUDA"
        )
        raise pytest.UsageError(f"REQUIRE_GPU=1 but CUDA is not usable: {why}")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


EN_DE = {
    "the": "die",
    "red": "rote",
    "green": "grüne",
    "small": "kleine",
    "old": "alte",
    "cat": "Katze",
    "house": "Haus",
    "file": "Datei",
    "window": "Fenster",
    "opens": "öffnet",
    "closes": "schließt",
    "sees": "sieht",
    "a": "eine",
    "door": "Tür",
    "list": "Liste",
    "new": "neue",
    "and": "und",
}
SUBJECTS = ["cat", "file", "window", "house", "list", "door"]
ADJECTIVES = ["red", "green", "small", "old", "new"]
VERBS = ["opens", "closes", "sees"]


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Word-for-word translatable sentences: learnable by a tiny model, varied enough for a tokenizer."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        words = [
            "the",
            rng.choice(ADJECTIVES),
            rng.choice(SUBJECTS),
            rng.choice(VERBS),
            "a",
            rng.choice(ADJECTIVES),
            rng.choice(SUBJECTS),
        ]
        if rng.random() < 0.5:
            words += ["and", "the", rng.choice(SUBJECTS)]
        english = " ".join(words) + f" {i % 97}"
        german = " ".join(EN_DE[w] for w in words) + f" {i % 97}"
        pairs.append((english, german))
    return pairs


def write_tsv(path: Path, pairs) -> Path:
    path.write_text("".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    return path


def prepare_args(corpus: Path, out: Path, **overrides) -> list[str]:
    """Command-line overrides for a tiny prepare of a TSV corpus."""
    settings = {
        "output_dir": str(out),
        "source.format": "tsv",
        "source.paths": f"[{corpus}]",
        "seq_len": 32,
        "tokenizer.vocab_size": 400,
        "tokenizer.sample_texts": 5000,
        "shard.max_samples": 40,
        "shard.buckets": 3,
        "split.valid": 0.1,
        "split.test": 0.1,
        "progress": "false",
    }
    settings.update({k: str(v) for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in settings.items()]


# Ports Ray takes by default for its own components when not told otherwise (GCS 6379, the
# dashboard 8265, the client server 10001, the dashboard agent's HTTP 52365) and its workers'
# default range: a head started on one of them refuses to start ("is trying to use a port number
# 52365 that is used by other components").
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365}) | frozenset(range(10002, 20000))


def free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, and not one of `avoid`."""
    import socket

    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in avoid:
            return port


def run_prepare(args: list[str], ray: "RayHead | None" = None) -> subprocess.CompletedProcess:
    """pipeline.prepare on the gettext config with `args`; with `ray`, as a driver of that running
    cluster (`ray.address`), else starting a local Ray of its own as by default."""
    joined = [f"ray.address={ray.address}"] if ray else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.prepare",
            str(ROOT / "configs/prepare_gettext_en_de.yaml"),
            *args,
            *joined,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ray.env if ray else None,
    )


class RayHead:
    """A one-node Ray cluster started as slurm/common.sh starts a job's head (`ray start --head
    --block`, token authentication, no dashboard), for the prepares that join it instead of
    starting a Ray of their own: ~5 s and ~4.5 CPU-s less per prepare on 2 cores (a tiny
    prepare: 8-9 s starting Ray, 3-3.4 s joining one). A joined prepare's output is the same
    bytes (the shards never depend on scheduling); Ray's own start and stop stay with the tests
    that check them (the tiny dataset, the interruption and lock tests)."""

    def __init__(self, num_cpus: int, cwd: Path | None = None):
        """`cwd`: the workers' working directory, against which a config's relative paths resolve."""
        import secrets

        port = free_port(avoid=RAY_DEFAULT_PORTS)
        self.address = f"127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--block",
                "--disable-usage-stats",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--include-dashboard=false",
                f"--num-cpus={num_cpus}",
            ],
            env=self.env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        seen = []
        for line in self.process.stdout:  # "Ray runtime started." once the head takes drivers
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise RuntimeError("ray start --head ended before it started:\n" + "".join(seen[-30:]))
        # never block its writes
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def stop(self) -> None:
        """SIGTERM to `ray start --block`, which stops what it started; whatever outlives it
        (workers the raylet started) is reaped as pipeline.prepare reaps a local Ray's, so no
        process of this cluster outlives the tests."""
        import psutil

        from pipeline.prepare.ray_runner import reap

        try:
            spawned = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            spawned = []
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        reap(spawned)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine's other cores serve subprocesses."""
    import torch

    torch.set_num_threads(1)


def write_tiny_corpus(directory: Path) -> Path:
    """600 synthetic pairs with some exact duplicates mixed in."""
    pairs = synthetic_pairs(600)
    pairs += pairs[:30]
    return write_tsv(directory / "pairs.tsv", pairs)


def prepare_tiny_dataset(corpus: Path, out: Path) -> Path:
    run = run_prepare(prepare_args(corpus, out, **{"ray.num_workers": 2}))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A session's shared artefact, `build(directory)` into a new directory, made once per run.

    `make test` runs the suite in 2 pytest-xdist workers (one session each); there the first
    worker to ask builds under an exclusive lock in the run's common temp root, and the other
    waits for it and reads the same files. A build that raised leaves no `.done` mark, so the
    next worker to ask builds again (and fails the same way, in its own tests)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        directory = tmp_path_factory.mktemp(name)
        build(directory)
        return directory
    root = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    directory, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "corpus", write_tiny_corpus) / "pairs.tsv"


@pytest.fixture(scope="session")
def tiny_dataset(tiny_corpus, tmp_path_factory) -> Path:
    """The tiny corpus prepared with 2 Ray workers (shared by the data and training tests). Where
    TINY_DATASET names one prepared beforehand the same way (`make gpu-bundle`, for a GPU node
    without Ray or a network), that one."""
    if os.environ.get("TINY_DATASET"):
        given = Path(os.environ["TINY_DATASET"])
        assert (given / "manifest.json").is_file(), (
            f"TINY_DATASET={given}: no prepared dataset there"
        )
        return given
    if importlib.util.find_spec("ray") is None:
        pytest.skip(
            "the tiny dataset is prepared with Ray, which is not installed here (or set TINY_DATASET)"
        )
    return (
        built_once(
            tmp_path_factory,
            "prepared",
            lambda top: prepare_tiny_dataset(tiny_corpus, top / "data"),
        )
        / "data"
    )


# ----------------------------------------------------------------------------- trained runs, once a
# session
# Each is a 2-rank torchrun job of launch.train (10-25 s on 2 cores, most of it start-up) that tests
# of several files assert on; their settings are in trainruns.py, which those files import.


@pytest.fixture(scope="session")
def uninterrupted_gpt(tiny_dataset, tmp_path_factory) -> Path:
    """Tiny GPT on 2 ranks under ZeRO-2, fp32, no dropout, 14 steps (trainruns.UNINTERRUPTED_GPT):
    the run test_elastic resumes against on other world sizes and test_compile's compiled ZeRO-3
    chain matches."""
    from trainruns import UNINTERRUPTED_GPT, run_train

    return built_once(
        tmp_path_factory,
        "uninterrupted-gpt",
        lambda run_dir: run_train(tiny_dataset, run_dir, *UNINTERRUPTED_GPT),
    )


@pytest.fixture(scope="session")
def dropout_zero3_gpt(tiny_dataset, tmp_path_factory) -> Path:
    """Tiny GPT on 2 ranks under ZeRO-3 with dropout 0.1, 10 steps, a checkpoint every 5
    (trainruns.DROPOUT_ZERO3): the uninterrupted run of test_train's resume and the run without
    activation checkpointing of test_zero_paths."""
    from trainruns import DROPOUT_ZERO3, train

    return built_once(
        tmp_path_factory,
        "dropout-zero3-gpt",
        lambda run_dir: train("tiny_gpt.yaml", tiny_dataset, run_dir, *DROPOUT_ZERO3),
    )


def _make_checkpoints(out: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
    }
    env["OMP_NUM_THREADS"] = "1"
    made = subprocess.run(
        [sys.executable, str(ROOT / "tests/launch/test_checkpoint_integrity.py"), "make", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-4000:]


@pytest.fixture(scope="session")
def made_checkpoints(tmp_path_factory) -> Path:
    """OUT/stage0 and OUT/stage2: run directories of a tiny GPT with two checkpoints each, ZeRO-0
    and ZeRO-2, as launch.train leaves them but without integrity.json (test_checkpoint_integrity's
    `make`, a one-process DeepSpeed engine; ~10 s): read, never written, by the checkpoint
    integrity and export tests, which copy what they change."""
    return built_once(tmp_path_factory, "checkpoints", _make_checkpoints)


# python tests/conftest.py OUT: the tiny dataset, prepared beforehand (TINY_DATASET)
if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        print(prepare_tiny_dataset(write_tiny_corpus(Path(scratch)), Path(sys.argv[1]).resolve()))


# --- Hugging Face tokenizers and models in the layouts users bring ------------------------------
# Built here with the `tokenizers` library, in the exact special-token layouts of GPT-2 (byte-level
# BPE, <|endoftext|> the last id, no pad), Llama (<unk> 0, <s> 1, </s> 2, byte fallback pieces
# next, <s> before every text) and BERT (WordPiece: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102,
# [MASK] 103, [CLS] text [SEP]), each saved with `save_pretrained` beside a tiny `transformers`
# model of its class: what `tokenizer.path=DIR` and `init.model=DIR` take.
HF_LAYOUTS = ("gpt2", "llama", "bert")
HF_VOCAB = 420  # pieces learned (plus each layout's special and byte pieces)


def layout_texts() -> list[str]:
    return [text for pair in synthetic_pairs(600) for text in pair]


def gpt2_layout_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=HF_VOCAB, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(["<|endoftext|>"])  # the last id, as GPT-2's 50256
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=end, eos_token=end, unk_token=end
    )


def llama_layout_tokenizer(texts: list[str]):
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    base.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=HF_VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    spec = json.loads(base.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])[3:]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})  # Llama's byte pieces
    for piece, _ in learned:
        vocab.setdefault(piece, len(vocab))
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def bert_layout_tokenizer(texts: list[str]):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(
            vocab_size=HF_VOCAB + len(specials), special_tokens=specials, show_progress=False
        ),
    )
    tok.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


LAYOUT_TOKENIZERS = {
    "gpt2": gpt2_layout_tokenizer,
    "llama": llama_layout_tokenizer,
    "bert": bert_layout_tokenizer,
}


def tiny_hf_model(layout: str, tokenizer):
    """A `transformers` model of the layout's class, tiny, seeded, sized to the tokenizer."""
    import transformers

    torch.manual_seed(0)
    vocab = len(tokenizer)
    if layout == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if layout == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def build_hf_layouts(directory: Path) -> None:
    """DIR/LAYOUT/: the layout's tokenizer and tiny model, saved as `save_pretrained` saves them."""
    texts = layout_texts()
    for layout in HF_LAYOUTS:
        tokenizer = LAYOUT_TOKENIZERS[layout](texts)
        tokenizer.save_pretrained(str(directory / layout))
        tiny_hf_model(layout, tokenizer).save_pretrained(str(directory / layout))


@pytest.fixture(scope="session")
def hf_layouts(tmp_path_factory) -> dict[str, Path]:
    """{layout: a Hugging Face directory with its tokenizer and a tiny model} for HF_LAYOUTS."""
    pytest.importorskip("transformers")
    top = built_once(tmp_path_factory, "hf-layouts", build_hf_layouts)
    return {layout: top / layout for layout in HF_LAYOUTS}


# Each layout's tokenizer (`tokenizer.path=DIR`) prepared on the synthetic corpus, for the tasks
# its model serves (BERT's masks, GPT-2's and Llama's causal blocks; the translation pairs with
# two of them): read, never written, by test_tokenizer_kinds (the ids in the shards) and
# test_hf_layouts (continued pretraining from the layout's model).
BERT2GPT2 = "bert2gpt2"
HF_LAYOUT_TASKS = {
    "gpt2": "[causal_lm,translation]",
    "llama": "[causal_lm]",
    "bert": "[mlm,translation]",
}


def build_hf_layout_data(layouts: dict[str, Path], directory: Path) -> None:
    """DIR/pairs.tsv, the corpus, and DIR/LAYOUT/, it prepared with each layout's tokenizer: three
    prepares joining one Ray cluster (RayHead) instead of starting a Ray each."""
    corpus = write_tsv(directory / "pairs.tsv", synthetic_pairs(600))
    ray = RayHead(num_cpus=2)
    try:
        for layout, tokenizer in layouts.items():
            args = prepare_args(corpus, directory / layout, **{"ray.num_workers": 2})
            args += [f"tokenizer.path={tokenizer}", f"tasks={HF_LAYOUT_TASKS[layout]}"]
            run = run_prepare(args, ray)
            assert run.returncode == 0, run.stderr[-3000:]
        # Rothe et al.'s BERT2GPT2: sources by BERT's WordPiece, targets by GPT-2's BPE.
        args = prepare_args(corpus, directory / BERT2GPT2, **{"ray.num_workers": 2})
        args += [
            f"tokenizer.path={layouts['bert']}",
            f"tokenizer.target_path={layouts['gpt2']}",
            "tasks=[translation]",
        ]
        run = run_prepare(args, ray)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        ray.stop()


@pytest.fixture(scope="session")
def hf_layout_top(hf_layouts, tmp_path_factory) -> Path:
    return built_once(
        tmp_path_factory, "hf-layout-data", lambda top: build_hf_layout_data(hf_layouts, top)
    )


@pytest.fixture(scope="session")
def hf_layout_corpus(hf_layout_top) -> Path:
    """The synthetic corpus (600 pairs) the layouts' datasets are prepared from."""
    return hf_layout_top / "pairs.tsv"


@pytest.fixture(scope="session")
def bert2gpt2_data(hf_layout_top) -> Path:
    """A translation dataset of hf_layout_corpus with two tokenizers: BERT's for the sources,
    GPT-2's for the targets (`tokenizer.target_path`)."""
    return hf_layout_top / BERT2GPT2


@pytest.fixture(scope="session")
def hf_layout_data(hf_layout_top) -> dict[str, Path]:
    """{layout: its dataset of hf_layout_corpus, HF_LAYOUT_TASKS[layout], 2 Ray workers}."""
    return {layout: hf_layout_top / layout for layout in HF_LAYOUTS}
