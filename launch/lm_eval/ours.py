"""Our GPT as an lm-evaluation-harness model: `OurLM`, registered as `pretrain-pipeline`.

A `TemplateLM`, so lm-eval itself splits each (context, continuation) into tokens as it does
for its `HFLM` (the whole text encoded, the context's tokens cut off the front); the same
requests through `HFLM` over our Hugging Face export give the same log-likelihoods
(tests/launch/test_lm_eval.py). An empty context, and each rolling window's first token, is
conditioned on the token every document follows in training (`pipeline.prepare.encode._Packer`):
the last of its tokenizer's document prefix (Llama's <s>), else the end of the previous
document (ours </s>, GPT-2's <|endoftext|>); it is also the `prefix_token_id` HFLM is given for
our exports.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pipeline.tokenizer import Tokenizer, load_tokenizer


@register_model("pretrain-pipeline")
class OurLM(TemplateLM):
    """A GPT in memory with the tokenizer it was trained with (a tokenizer file or a directory
    holding one; `from_export`: an exported directory of ours, `launch.export`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer | str | Path,
        batch_size: int | str = 16,
        device: str | torch.device | None = None,
        max_gen_toks: int = 64,
    ):
        super().__init__()
        if model.cfg.arch != "gpt":
            raise ValueError(f"OurLM scores causal language models; this one is {model.cfg.arch}")
        self.model = model
        self.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
        self.batch_size_per_rank = int(batch_size)
        self.max_gen_toks = max_gen_toks
        self._device = torch.device(device) if device else next(model.parameters()).device
        if device:
            self.model.to(self._device)

    @classmethod
    def from_export(cls, directory: str | Path, **kwargs) -> "OurLM":
        """The GPT of an exported directory with the tokenizer beside it."""
        from launch.model_dir import load_model_dir

        model, _ = load_model_dir(directory)
        return cls(model, directory, **kwargs)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "OurLM":
        """`--model pretrain-pipeline --model_args pretrained=DIR[,batch_size=N]`."""
        args = dict(arg_dict)
        directory = args.pop("pretrained")
        extra = {
            key: value
            for key, value in (additional_config or {}).items()
            if key in ("batch_size", "device") and value is not None
        }
        return cls.from_export(directory, **{**args, **extra})

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict | None = None
    ) -> "OurLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.specials.document_end

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.specials.document_prefix

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        # nothing added: the pipeline frames documents itself
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation)
        per (_, context ids, continuation ids); longer than the model's positions, the input is
        cut on the left as HFLM cuts it. Batches of similar lengths, right-padded."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(
            range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2])
        )
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size_per_rank):
                batch = order[start : start + self.batch_size_per_rank]
                if any(len(requests[i][2]) > self.max_length for i in batch):  # as HFLM refuses it
                    raise ValueError(
                        f"a continuation longer than the model's {self.max_length} positions"
                    )
                inputs = [
                    (requests[i][1] + requests[i][2])[-(self.max_length + 1) :][:-1] for i in batch
                ]
                width = max(map(len, inputs))
                ids = torch.full((len(batch), width), self.model.cfg.pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, tokens in enumerate(inputs):
                    ids[row, : len(tokens)] = torch.tensor(tokens)
                    mask[row, : len(tokens)] = 1
                logits = self.model(ids.to(self.device), mask.to(self.device)).logits  # (B, T, V)
                logprobs = F.log_softmax(logits.float(), dim=-1)
                for row, index in enumerate(batch):
                    continuation = requests[index][2]
                    end = len(inputs[row])
                    # (C, V): the positions predicting it
                    scored = logprobs[row, end - len(continuation) : end]
                    target = torch.tensor(continuation, device=scored.device)
                    total = scored.gather(-1, target[:, None]).sum().item()
                    results[index] = (total, bool((scored.argmax(-1) == target).all()))
        finally:
            self.model.train(was_training)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in windows of the model's positions, the first
        conditioned on </s> (lm-eval's rolling windows, as HFLM makes them)."""
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens(
                [(None, context, continuation) for context, continuation in windows]
            )
            totals.append(sum(score for score, _ in scores))
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) continuations by `GPT.generate`, cut at the first
        stop string; the context is cut on the left to leave room for max_gen_toks."""
        outputs = []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_gen_toks = min(kwargs.pop("max_gen_toks"), self.max_length - 1)
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks) :] or [
                self.prefix_token_id
            ]
            sampling = {
                key: kwargs[key] for key in ("temperature", "top_k", "top_p") if key in kwargs
            }
            do_sample = bool(kwargs.get("do_sample")) and sampling.get("temperature", 1.0) > 0
            new = self.model.generate(
                torch.tensor([ids], device=self.device),
                max_new_tokens=max_gen_toks,
                eos_id=self.eot_token_id,
                do_sample=do_sample,
                **(sampling if do_sample else {}),
            )
            tokens = new[0, len(ids) :].tolist()
            end = self.eot_token_id
            tokens = tokens[: tokens.index(end)] if end in tokens else tokens
            outputs.append(postprocess_generated_text(self.tok_decode(tokens), until, None))
        return outputs
