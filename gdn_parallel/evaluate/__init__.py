"""Evaluations of trained checkpoints (docs/design.md §4: the top layer, above train and convert, whose
checkpoint loading and evaluation pieces they use).

    niah.py   gdn-eval-niah: passkey retrieval by context length and needle depth, loss by position
"""
