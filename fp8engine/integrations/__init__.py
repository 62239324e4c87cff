"""Plugins for other RL frameworks, over fp8engine's own engine API (they import fp8engine, never the reverse).

- `fp8engine.integrations.verl`: a veRL 0.9.1 rollout backend (`actor_rollout_ref.rollout.name=fp8engine`),
  registered through veRL's `verl.plugins` entry point. Importing `fp8engine` never imports veRL.
"""
