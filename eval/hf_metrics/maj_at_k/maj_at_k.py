"""maj@k as an ``evaluate`` metric module, loaded by path: ``evaluate.load("/path/to/eval/hf_metrics/maj_at_k")``."""

import datasets
import evaluate

from eval.metrics import maj_at_k
from reward_models.math_answers import normalize_text

_DESCRIPTION = """maj@k (majority voting, Wang et al. 2022 self-consistency, arXiv 2203.11171) averaged over
problems. predictions: per problem, the extracted answers of its samples ("" = no answer, does not vote);
references: per problem, the reference answer. Answers are compared after normalisation (lower case,
punctuation and extra whitespace removed). Ties: the tied answer voted first wins. k: an int or a list
(default: every k up to the smallest n). Returns {"maj@k": value, ...}."""
_CITATION = """@article{wang2022selfconsistency, title={Self-Consistency Improves Chain of Thought Reasoning in
Language Models}, author={Wang, Xuezhi and others}, journal={arXiv preprint arXiv:2203.11171}, year={2022}}"""


class MajAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("string")), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, k=None):
        n_min = min(len(p) for p in predictions)
        ks = range(1, n_min + 1) if k is None else ([k] if isinstance(k, int) else k)
        out = {}
        for kk in ks:
            hits = 0
            for answers, ref in zip(predictions, references):
                keys = [normalize_text(a) or None for a in answers]
                hits += maj_at_k(keys, [key == normalize_text(ref) for key in keys], kk)
            out[f"maj@{kk}"] = hits / len(predictions)
        return out
