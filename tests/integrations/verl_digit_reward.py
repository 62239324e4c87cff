"""The dense reward of test_verl_grpo.py, as veRL's custom_reward_function: the share of digit characters in the
response (0 for an empty one), so every sample gets a graded score and GRPO's advantages are rarely all zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
