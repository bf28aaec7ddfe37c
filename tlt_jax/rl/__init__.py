"""The RL step: advantages, losses, rewards, batching, the policy update and the learner."""
