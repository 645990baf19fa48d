"""Quality before and after: perplexity, KL divergence and top-1 agreement on token windows (`perplexity.py`),
bootstrap intervals and paired differences (`intervals.py`), and zero-shot tasks through lm-evaluation-harness
(`lm_eval_tasks.py`)."""
