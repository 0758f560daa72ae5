"""Configuration schema of `pipeline.prepare`: sources, splits, tokenizer, shards and Ray.

`configs/prepare_*.yaml` are instances of `PrepareConfig`. See `common.configure` for how YAML
and overrides are merged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from pipeline.format import TASKS
from pipeline.prepare.curate.decontaminate import DecontaminationConfig
from pipeline.prepare.curate.language import LanguageConfig
from pipeline.prepare.curate.near_dedup_config import NearDedupConfig
from pipeline.prepare.curate.pii import PiiConfig
from pipeline.prepare.curate.quality_config import QualityConfig


@dataclass
class SourceConfig:
    # The source's name: its shards' folder and its key in the manifest's per-source counts
    # (and in a training mixture). Letters, digits, '_', '.', '-'.
    name: str = "default"
    # text: one document per line or per blank-line-separated paragraph (`text_split`);
    # jsonl: a document in `text_field` (a pair when `target_field` is set too);
    # tsv: (source, target) pairs in `source_column` and `target_column`;
    # gettext: compiled .mo or source .po catalogs, msgid -> msgstr pairs;
    # parquet: a string column `text_field` (and `target_field` for pairs), read row group by row
    # group;
    # manpage: roff man pages (man(7) macros), their paragraphs of running text (monolingual).
    format: str = "gettext"
    # Files or globs; `.gz` and `.zst` files are read decompressed. The default is the system's
    # English->German message catalogs, which every Debian or Ubuntu machine has.
    paths: List[str] = field(
        default_factory=lambda: ["/usr/share/locale/${source.target_lang}/LC_MESSAGES/*.mo"]
    )
    source_lang: str = "en"  # language of the source side; a label kept in the manifest
    target_lang: str = "de"  # language of the target side; the default paths use it
    text_split: str = "line"  # line | paragraph
    text_field: str = "text"  # jsonl: the key of the (source) text; parquet: its column
    target_field: str = ""  # jsonl, parquet: the key (column) of the target text; "" = monolingual
    source_column: int = 0  # tsv: column of the source text (from 0)
    target_column: int = 1  # tsv: column of the target text (from 0)
    # tsv: how many tab-separated columns every line has; 0 = just those `source_column` and
    # `target_column` need (2 by default). A line with another count is skipped and counted as
    # malformed, never read in part: a tab inside a text would shift the columns after it.
    columns: int = 0
    # Longer monolingual documents are cut into pieces of at most this many characters,
    # so one pathological line never holds a whole file's worth of memory downstream.
    max_doc_chars: int = 20000
    # manpage: paragraphs of fewer words are dropped (option tags, headings, one-line notes).
    min_words: int = 5
    # A text (either side of a pair) in which more than this fraction of the characters are
    # U+FFFD, put in for bytes that are not valid UTF-8 (or not the catalog's charset), is
    # dropped and counted as `undecodable_dropped`: binary or random data comes out near 0.45,
    # while a stray bad byte in a sentence, or Latin-1 text read as UTF-8 (1-3% of the
    # characters), stays below and is kept, replaced. A source in which over half the texts
    # are dropped for this stops prepare. 1.0 keeps every text.
    max_replaced_fraction: float = 0.1
    # With several sources: this source's relative share of the tokenizer's training sample.
    # The sample's `tokenizer.sample_texts` slots are divided in proportion to the shares; a
    # source with fewer distinct training texts than its slots gives all it has and its unused
    # slots go to the others, again in proportion. Within a source the texts are its bottom-k
    # by salted hash, as with one source.
    tokenizer_share: float = 1.0
    # Curation stages, per record in this order (docs/data.md, "Curation"): language
    # identification (each side of a pair against its own language), the heuristic quality
    # rules (documents only), PII replacement. Each counts what it drops per rule and split in
    # manifest.json and keeps a sample under DATASET/dropped/.
    language: LanguageConfig = field(default_factory=LanguageConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    pii: PiiConfig = field(default_factory=PiiConfig)
    # Whether this source's documents take part in `near_dedup` when that stage is enabled.
    near_dedup: bool = True
    # Whether this source's training texts are checked by `decontamination` when it is enabled.
    decontaminate: bool = True


@dataclass
class SplitConfig:
    # Fractions of the distinct (normalized) texts; train gets the rest. A pair's split is
    # decided by its source side, and both sides of a pair inherit it when used as
    # monolingual text, so a test sentence is never seen in pretraining.
    valid: float = 0.02
    test: float = 0.02  # fraction of the distinct texts in the test split
    salt: str = "split-v1"  # salt of the text hashes that decide splits and buckets


@dataclass
class TokenizerConfig:
    # A given tokenizer instead of a trained one: a SentencePiece .model of the project's layout
    # (a pretraining dataset's, so that fine-tuning data shares its ids), or a Hugging Face
    # tokenizer.json or tokenizer/model directory (GPT-2, Llama, BERT, a group's own); its kind is
    # read from it. "" = train one with `kind`'s library.
    path: str = ""
    # translation: the target side's own tokenizer (a .model, a tokenizer.json or a Hugging Face
    # directory), e.g. a GPT-2 decoder's BPE beside a BERT encoder's WordPiece in `path` (Rothe et
    # al.'s BERT2GPT2); "" = both sides use the one tokenizer. Needs `path`.
    target_path: str = ""
    # The library that trains the tokenizer when no path is given: sentencepiece (model_type
    # unigram | bpe) | hf (the tokenizers library: model_type bpe, a byte-level BPE as GPT-2's).
    kind: str = "sentencepiece"
    model_type: str = "unigram"  # unigram | bpe
    vocab_size: int = 8000  # requested size; a small corpus may give fewer pieces
    # SentencePiece: fraction of characters the vocabulary covers
    character_coverage: float = 0.9995
    byte_fallback: bool = True  # SentencePiece: unknown characters become byte pieces, not `<unk>`
    # Size cap of the training sample: the texts with the smallest salted hashes, so the
    # sample is reproducible, independent of input order and drawn in one streaming pass.
    sample_texts: int = 200000
    # Training texts longer than this many UTF-8 bytes are cut at spaces into pieces of at most
    # this size, each a text of the sample (SentencePiece would skip a longer one whole).
    max_sentence_length: int = 4192
    # Extra control symbols such as target-language tags ("<2de>").
    lang_tags: List[str] = field(default_factory=list)
    num_threads: int = 2  # SentencePiece training threads


@dataclass
class ShardConfig:
    max_samples: int = 4096  # samples per tar shard at most
    # Texts are hash-partitioned into this many buckets; one Ray task encodes one
    # (split, bucket). Output depends on this number, never on the number of workers.
    buckets: int = 8


@dataclass
class TranslationFilterConfig:
    min_tokens: int = 1  # pairs whose shorter side has fewer tokens are dropped
    max_tokens: int = 128  # pairs whose longer side has more tokens are dropped
    max_ratio: float = 3.0  # longer side / shorter side, in tokens
    # false: source_lang -> target_lang; true: the reverse direction.
    reverse: bool = False


@dataclass
class RayConfig:
    # "" starts a local Ray; "auto" or "host:port" joins an existing cluster.
    address: str = ""
    # Tasks in flight at once (and CPUs of a local Ray).
    num_workers: int = 2


@dataclass
class PrepareConfig:
    output_dir: str = "data/gettext-en-de"  # the dataset: shards, manifest.json, tokenizer
    # replace an earlier dataset in output_dir (refused otherwise); a directory holding anything
    # prepare did not write, or the run's own inputs, is never replaced
    overwrite: bool = False
    # keep the staging directory (OUTPUT_DIR.partial-TOKEN) after a failed or interrupted run, to
    # debug it
    keep_partial: bool = False
    # a run stopped after its scan (SIGTERM, Ctrl-C, a time limit, kill -9) keeps its staging
    # directory, and the next run of the same config on the same inputs goes on from its scan,
    # writing the same bytes as an uninterrupted run; false: every run starts afresh
    resume: bool = True
    tasks: List[str] = field(default_factory=lambda: list(TASKS))  # the tasks to write shards for
    seq_len: int = 128  # tokens per packed causal_lm / mlm block
    # Bytes of input per scan work unit: larger text, jsonl and tsv files are cut into ranges
    # of this size; compressed ones (.gz, .zst) larger than this are decompressed by the driver
    # and handed to the workers in chunks of this many decompressed bytes. Parquet files are
    # cut into runs of row groups of about this size. The most: inputs under 64 units of it are
    # cut into 64 (units of 8 MiB at least), so the last scan tasks are small. The output never
    # depends on it.
    unit_bytes: int = 64 << 20
    source: SourceConfig = field(default_factory=SourceConfig)
    # Several sources in one prepare, each with its own `name`, format, paths and fields (the
    # keys of `source`); each keeps its own shards and counts. Splits and de-duplication are
    # global: a text's split depends on the text alone, and a text found in two sources is kept
    # by the one listed first. Translation pairs come from the parallel sources only. Give
    # either `source` or `sources`, not both; [] = the single `source`.
    sources: List[SourceConfig] = field(default_factory=list)
    split: SplitConfig = field(default_factory=SplitConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    translation: TranslationFilterConfig = field(default_factory=TranslationFilterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    # Near-duplicate removal across the whole corpus (MinHash LSH over word n-grams; within
    # each split: the splits are kept apart by decontamination), one document kept per cluster.
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    # Training texts overlapping the valid/test splits or named evaluation files are dropped.
    decontamination: DecontaminationConfig = field(default_factory=DecontaminationConfig)
    # Dropped texts kept per rule and source under DATASET/dropped/ (the same ones for any
    # number of workers); 0 keeps none.
    dropped_samples: int = 20
    progress: bool = True  # progress bars and log lines on stderr
