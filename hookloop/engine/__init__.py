"""The loop's owners: dispatch, state, the position in the data, the forward rules, the
optimizer step, the checks at fit start, capturing and restoring the run's state.

See docs/architecture.md for what each module does and may import.
"""
