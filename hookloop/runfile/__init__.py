"""The run file: its format, writing and reading it, its integrity, and every storage path
(one file, a directory of shards, async, rotation, top-k, best, rollback).

See docs/architecture.md for what each module does and may import.
"""
