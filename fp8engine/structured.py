"""Structured outputs: SamplingParams' json_schema / regex / grammar compiled by xgrammar (the grammar engine vLLM
and SGLang default to), and one matcher per sample that gives the tokens allowed next.

A request's grammar is compiled once (GrammarCompiler.compile, cached by xgrammar) and shared by its samples; each
sample's Matcher follows its tokens as they are appended and gives the next token's allowed set as a bool mask
[vocab], which the sampler applies (model_executor/layers/sampler.py): the draw, the greedy argmax and processed
logprobs see only allowed tokens, raw logprobs are untouched, and log_kept_mass counts the mask's share. A matcher
depends on the sample's tokens alone, so a preempted or re-prefilled sample resumes where it was.
"""

import re

import torch

from fp8engine.sampling_params import SamplingParams

_BITS = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32)


class GrammarCompiler:
    """Compiles a request's structured-output option against one tokenizer; the tokenizer's vocabulary is read on
    the first structured request (about 0.1 s for 49K tokens), not at engine start."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler = None

    def compile(self, params: SamplingParams) -> "Grammar | None":
        """The grammar params ask for (None without one); ValueError names the option that does not compile."""
        name, value = params.structured
        if name is None:
            return None
        compiler = self._xgrammar_compiler()
        try:
            if name == "json_schema":
                compiled = compiler.compile_json_schema(value, any_whitespace=False)
            elif name == "regex":
                compiled = compiler.compile_regex(value)
            else:
                compiled = compiler.compile_grammar(value)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"SamplingParams.{name} cannot be compiled: {compile_error(exc)}") from None
        stops = sorted(self.eos_token_ids | set(params.stop_token_ids))
        return Grammar(compiled, stops, self.vocab_size)

    def _xgrammar_compiler(self):
        if self._compiler is None:
            import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=sorted(self.eos_token_ids))
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def compile_error(exc: Exception) -> str:
    """xgrammar's message for a grammar it rejects, without the time stamp and C++ source location before it."""
    return re.sub(r"^\[[^\]]*\]\s*(\S+:\d+:\s*)?", "", str(exc).strip().splitlines()[-1])


class Grammar:
    """A compiled grammar and the tokens that end a sample once it is complete."""

    def __init__(self, compiled, stop_token_ids: list[int], vocab_size: int):
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """Where one sample is in its grammar."""

    def __init__(self, grammar: Grammar):
        import xgrammar
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=grammar.stop_token_ids)
        self._bitmask = xgrammar.allocate_token_bitmask(1, grammar.vocab_size)
        self.vocab_size = grammar.vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool mask [vocab]: the tokens the grammar allows next (stop tokens once it may end)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return ((self._bitmask[0, :, None] & _BITS) != 0).flatten()[:self.vocab_size]

    def accept(self, token_id: int) -> None:
        """Move past token_id, which allowed() permitted (the sampler draws no other)."""
        accepted = self.follows(token_id)
        assert accepted, f"token {token_id} was sampled outside the grammar"

    def follows(self, token_id: int) -> bool:
        """Move past token_id if the grammar allows it there; whether it did."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

