"""pass@k as an ``evaluate`` metric module, loaded by path: ``evaluate.load("/path/to/eval/hf_metrics/pass_at_k")``."""

import datasets
import evaluate

from eval.metrics import pass_at_k

_DESCRIPTION = """Unbiased pass@k (Chen et al. 2021, arXiv 2107.03374, eq. 1) averaged over problems.
predictions: per problem, the correctness (0/1) of each of its n samples. k: an int or a list of ints
(default: every k up to the smallest n). Returns {"pass@k": value, ...}."""
_CITATION = """@article{chen2021codex, title={Evaluating Large Language Models Trained on Code},
author={Chen, Mark and others}, journal={arXiv preprint arXiv:2107.03374}, year={2021}}"""


class PassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int32"))}),
        )

    def _compute(self, predictions, k=None):
        n_min = min(len(p) for p in predictions)
        ks = range(1, n_min + 1) if k is None else ([k] if isinstance(k, int) else k)
        return {f"pass@{kk}": sum(pass_at_k(len(p), sum(p), kk) for p in predictions) / len(predictions) for kk in ks}
