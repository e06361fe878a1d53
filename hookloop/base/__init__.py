"""The floor every other one stands on: generic argument checks, an OSError's cause in
words, deprecations, versions, torch compatibility, the event and phase vocabularies,
clocks.

See docs/architecture.md for what each module does and may import.
"""
