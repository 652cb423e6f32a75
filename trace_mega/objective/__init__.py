"""The RL objective: advantage estimators over rollout trees (`advantages`: grpo | rloo | tree | gigpo, plus
TRACE-C's turn credit) and the policy losses (`losses`: PPO-clip, DAPO, GSPO, k3 KL, entropy)."""
