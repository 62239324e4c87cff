"""Incremental detokenization equals decoding the whole output, token by token."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fp8engine.detokenizer import DetokState, Detokenizer


def _check_growth(tokenizer, sequences):
    detok = Detokenizer(tokenizer)
    assert detok.incremental
    for ids in sequences:
        state = DetokState()
        for n in range(1, len(ids) + 1):
            assert detok.text(state, ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True), ids[:n]


def test_byte_level_bpe_random_tokens(tokenizer):
    # Random ids include lone UTF-8 continuation bytes and special tokens: texts with replacement
    # characters in the middle and at the end, which must not settle early.
    rng = random.Random(0)
    vocab = len(tokenizer)
    byte_heavy = [tokenizer.convert_tokens_to_ids(t) for t in ("Ã", "Â", "ð", "Ł", "ł", "Ġ")]
    sequences = [[rng.choice(byte_heavy) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(40)]
                 for _ in range(60)]
    sequences.append(tokenizer("naïve café – 日本語のテキスト 🚀 done")["input_ids"])
    _check_growth(tokenizer, sequences)


def test_sentencepiece_style_metaspace():
    # A Metaspace decoder drops the leading space of a decode's first token; the context tokens make
    # the two partial decodes agree on it.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the keeper climbed the lighthouse stairs", "a storm rolled over the grey sea at night",
              "every evening he lit the lamp and wrote in his log"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    rng = random.Random(1)
    sequences = [fast(line)["input_ids"] for line in corpus[:3]]
    sequences += [[rng.randrange(len(fast)) for _ in range(30)] for _ in range(30)]
    _check_growth(fast, sequences)


def test_space_cleanup_tokenizers_decode_whole(tokenizer):
    class Cleanup:
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert not Detokenizer(Cleanup()).incremental


@pytest.mark.parametrize("stream", [True, False])
def test_engine_streaming_text_matches_final_text(engine_fp32, stream):
    from fp8engine import SamplingParams
    params = SamplingParams(temperature=0.8, max_tokens=60, seed=5, ignore_eos=True)
    if not stream:
        out = engine_fp32.generate(["Tell me about the sea."], params)[0].outputs[0]
        assert out.text == engine_fp32.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return
    rid = engine_fp32.add_request("Tell me about the sea.", params)
    texts = []
    while engine_fp32.has_unfinished_requests():
        for o in engine_fp32.step():
            if o.request_id == rid:
                c = o.outputs[0]
                assert c.text == engine_fp32.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                texts.append(c.text)
    assert len(texts) == 60
