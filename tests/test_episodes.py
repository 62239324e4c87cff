"""Multi-turn episodes: the history is exactly prompt + sampled + observation tokens (nothing re-rendered), masks,
logprobs and versions mark model tokens only, rewards and turns come back per episode, seeds reproduce and
separate episodes; an in-process batch replays bitwise; a RolloutClient gives the same episodes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8engine import EngineConfig, SamplingParams
from fp8engine.bench.serve_load import serving
from fp8engine.rl import RolloutClient, RolloutEngine
from fp8engine.rl.episodes import rollout_episodes
from fp8engine.tools import continuation_ids, forced_call_grammar, render_ids

CONFIG = dict(dtype="bfloat16", batch_invariant=True, num_kv_blocks=256)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from agent_grpo import CALC, calc  # noqa: E402 (the example's tool, its schema and its evaluator)


class Calculator:
    """Asks a product; executes calc calls (the result as a tool message); rewards a final answer with it."""

    tools = [CALC]
    made: list["Calculator"] = []

    def __init__(self):
        self.turns, self.observations = [], []
        Calculator.made.append(self)

    def reset(self, prompt):
        self.a, self.b = prompt
        return [{"role": "user", "content": f"What is {self.a}*{self.b}? Use the calc tool, then answer."}]

    def step(self, turn):
        self.turns.append(turn)
        if turn.tool_calls:
            result = calc(turn.tool_calls[0].arguments)  # free turns may call with anything
            obs = [{"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": result}]
            self.observations.append(obs)
            return obs, 0.25, False
        return None, float(str(self.a * self.b) in turn.content), True


def forced_first(turn: int) -> SamplingParams:
    grammar = forced_call_grammar("hermes", [CALC], "calc") if turn == 0 else None
    return SamplingParams(temperature=1.0, max_tokens=40, seed=4, grammar=grammar)


@pytest.fixture(scope="module")
def rollouts():
    return RolloutEngine(EngineConfig(**CONFIG))


def test_the_history_is_prompt_plus_sampled_plus_observation_tokens(rollouts):
    tokenizer = rollouts.tokenizer
    Calculator.made = []
    batch = rollout_episodes(rollouts, Calculator, [(17, 23), (6, 7)], n=3, sampling_params=forced_first,
                             max_turns=3)
    assert batch.batch_size == 6 and batch.n == 3
    prompts, responses = batch.prompts_and_responses()
    eos = {tokenizer.eos_token_id}
    for i, env in enumerate(Calculator.made):
        expected_prompt = render_ids(tokenizer, env.reset((env.a, env.b)), [CALC])
        assert prompts[i] == expected_prompt
        history, mask = list(expected_prompt), []
        for j, turn in enumerate(env.turns):
            history += turn.token_ids
            mask += [1] * len(turn.token_ids)
            if j < len(env.observations):
                obs = continuation_ids(tokenizer, history, env.observations[j], eos)
                history += obs
                mask += [0] * len(obs)
        assert prompts[i] + responses[i] == history
        width = len(mask)
        assert batch.response_mask[i, :width].tolist() == mask and not batch.response_mask[i, width:].any()
        model = batch.response_mask[i, :width].bool()
        logprobs = batch.rollout_logprobs[i, :width]
        assert (logprobs[~model] == 0).all() and (logprobs[model] < 0).any()
        versions = batch.token_weight_versions[i, :width]
        assert (versions[~model] == -1).all() and (versions[model] == 0).all()
        assert batch.num_turns[i] == len(env.turns) and env.turns[0].tool_calls  # the first turn was a forced call
        assert batch.rewards[i] == pytest.approx(0.25 * len(env.observations) + float(
            not env.turns[-1].tool_calls and str(env.a * env.b) in env.turns[-1].content))
    assert batch.stats["num_model_calls"] == int(batch.num_turns.max())
    assert len({tuple(r) for r in responses[:3]}) == 3  # the episodes of one prompt draw their own noise
    assert batch.stats["prefill_tokens_by_turn"][1] < batch.stats["prompt_tokens_by_turn"][1]  # the prefix cache
    again = rollout_episodes(rollouts, Calculator, [(17, 23), (6, 7)], n=3, sampling_params=forced_first, max_turns=3)
    assert torch.equal(again.response_ids, batch.response_ids) and torch.equal(again.rollout_logprobs,
                                                                               batch.rollout_logprobs)


class Chatter:
    """Three turns, each answered by the same user message."""

    def reset(self, prompt):
        return [{"role": "user", "content": prompt}]

    def step(self, turn):
        return [{"role": "user", "content": "Say more."}], len(turn.token_ids) / 100, False


def test_an_in_process_batch_replays_bitwise_on_model_tokens(rollouts):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=2)
    batch = rollout_episodes(rollouts, Chatter, ["Tell me about owls.", "Why is the sky blue?"], n=2,
                             sampling_params=params, max_turns=3)
    assert (batch.num_turns == 3).all() and batch.stats["observation_tokens"] > 0
    prompts, responses = batch.prompts_and_responses()
    scored = batch.scorer(prompts, responses, params)
    for i, row in enumerate(scored):
        model = batch.response_mask[i, :len(row)].bool()
        assert torch.equal(torch.tensor(row)[model], batch.rollout_logprobs[i, :len(row)][model])


def test_bad_arguments_are_clear_errors(rollouts):
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        rollout_episodes(rollouts, Chatter, ["x"], max_turns=0)

    class Silent(Chatter):
        def reset(self, prompt):
            return "not messages"
    with pytest.raises(ValueError, match="env.reset must return chat messages or token ids"):
        rollout_episodes(rollouts, Silent, ["x"])
    with pytest.raises(TypeError, match=r"sampling_params\(0\) must return SamplingParams"):
        rollout_episodes(rollouts, Chatter, ["x"], sampling_params=lambda turn: None)
    assert not rollouts.engine.requests


def test_a_client_over_http_gives_the_same_episodes(rollouts):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=8)
    expected = rollout_episodes(rollouts, Chatter, ["Name a bird."], n=2, sampling_params=params, max_turns=2)
    flags = ["--dtype", CONFIG["dtype"], "--batch-invariant", "--num-kv-blocks", str(CONFIG["num_kv_blocks"])]
    with serving(flags) as url:
        client = RolloutClient(url)
        got = rollout_episodes(client, Chatter, ["Name a bird."], n=2, sampling_params=params, max_turns=2)
    for name in ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "token_weight_versions",
                 "num_turns", "rewards"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_the_agent_grpo_example_runs_two_steps(tmp_path):
    """examples/agent_grpo.py --smoke: 2 GRPO steps of 2 prompts x n=2 episodes, metrics and the plot written."""
    out, png = tmp_path / "agent.json", tmp_path / "agent.png"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_grpo.py"), "--smoke", "--threads", "2",
                          "--json", str(out), "--png", str(png)], capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0 and 1.0 <= s["turns_mean"] <= 3.0
        assert s["observation_tokens"] > 0 and s["prefill_tokens"] < s["prompt_tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
