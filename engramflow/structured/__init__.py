"""Grammar-constrained decoding (xgrammar): structured outputs and forced tool calls.

vocabulary.py   the checkpoint's tokenizer as xgrammar sees it (token ids -> bytes)
grammars.py     a request's grammar (JSON schema, regex, choice, EBNF, tool calls) compiled once, cached
tool_calls.py   the DSML tool-call block a forced `tool_choice` must write, as a structural tag
constraint.py   one request's matcher: the mask of its next token, advanced with each picked token
masked_pick.py  the mask applied on the last stage, before the request's own token choice

This __init__ imports nothing: the last stage unpickles a MaskedPick (masked_pick.py, torch
only) and must not pay for importing xgrammar.
"""
