"""Training code for the bundled model family: corpus, tokenizer, causal LMs.

`python -m specdec_fast.train --help` lists the commands; the bundled checkpoints' READMEs give the
exact commands that produced them.
"""
