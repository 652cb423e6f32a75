"""TRACE-C, turn-level credit (docs/design.md §4): the reference probe of the gold answer at every tool
boundary (`probe`), the log-ratio state values and K-step TD credit (`turn_credit`), and the credit-accuracy
metrics against environment turn labels (`metrics`)."""
