"""The RL training loop (rollout -> rewards -> advantages -> log-probs -> K inner updates -> metrics)."""
