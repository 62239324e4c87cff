"""Token embedding and LM head. Both stay in the model dtype, as the FP8-RL recipe has it, unless
EngineConfig.lm_head_fp8 makes the head an FP8 linear (FP8LMHead)."""

import torch
from torch import nn
from torch.nn import functional as F

from fp8engine.model_executor.kernel_set import KernelSet
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.weights import layout


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.in_layout:  # tied to a head stored in the nt16 layout
            return layout.embedding(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)

    @property
    def in_layout(self) -> bool:
        return layout.is_marked(self.weight)


class LMHead(nn.Module):
    """Logits in the model dtype, or float32 (kernels.lm_head_fp32: every product and sum in float32, from a
    float32 input); shares its weight with the embedding when the model ties them.

    Tensor parallelism (shard_vocab): a rank's head computes the logits of its rows of the vocabulary only; a tied
    head reads those rows of the replicated embedding (a view taken per call: the embedding's storage moves to the
    engine's own mapping after the model is built), an untied one holds just them."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, kernels: KernelSet,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.__dict__["tied_to"] = tied_to  # not a submodule: the embedding is the model's, named there
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.kernels = kernels
        self.vocab_rows: tuple[int, int, int] | None = None  # (start, stop, full vocabulary) of a rank's rows

    def shard_vocab(self, start: int, stop: int) -> None:
        """Tensor parallelism: this rank computes the logits of vocabulary rows start .. stop - 1 (before the
        weights load)."""
        full = self.weight.shape[0]
        self.vocab_rows = (start, stop, full)
        if self.tied_to is None:
            self.weight = nn.Parameter(self.weight.new_empty(stop - start, self.weight.shape[1]), requires_grad=False)

    @property
    def row_slices(self) -> dict[str, tuple[int, int, int]]:
        """The loader's TPSlice of a rank's own weight: an untied head's vocabulary rows (a tied one's name is the
        embedding's, which every rank holds whole)."""
        return {"weight": self.vocab_rows} if self.tied_to is None and self.vocab_rows is not None else {}

    @property
    def fp32(self) -> bool:
        return self.kernels.lm_head_fp32

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tied_to is not None and self.vocab_rows is not None:
            return self.kernels.lm_head(hidden, self.tied_to.weight[self.vocab_rows[0]:self.vocab_rows[1]])
        return self.kernels.lm_head(hidden, self.weight)


class FP8LMHead(Linear):
    """The LM head as a block-FP8 linear (E4M3 weight, 128x128 scales; logits in the model dtype). With tied
    embeddings it holds its own quantized copy of the embedding, which the weight loader writes whenever the
    embedding is written (weights/loader.py: the embedding's target mirrors into this one)."""

    fp32 = False

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, kernels: KernelSet,
                 scale_fmt: str | None = None):
        super().__init__(hidden_size, [vocab_size], dtype, kernels, fp8=True, scale_fmt=scale_fmt)
        self.vocab_rows: tuple[int, int, int] | None = None

    def shard_vocab(self, start: int, stop: int) -> None:
        """Tensor parallelism: this rank holds the codes and scales of vocabulary rows start .. stop - 1 (a column
        shard: whole 128-row blocks where start is a block boundary, as tensor_parallel.vocab_rows makes it)."""
        full = self.out_features
        self.vocab_rows = (start, stop, full)
        self.shard_sizes, self.out_features = [stop - start], stop - start
        self.weight = nn.Parameter(self.weight.new_empty(stop - start, self.in_features), requires_grad=False)
        self.shard_for_tp(rows=[(start, full)])
