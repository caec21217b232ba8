"""vlrft's benchmark metrics as an ``evaluate`` metric module, loaded by path:

``evaluate.load("/path/to/eval/hf_metrics/rule_verifier")``
``.compute(predictions=..., references=..., verifier="gsm8k")``."""

import datasets
import evaluate

from data_pipelines.records import PromptRecord
from eval.metrics import summarize
from eval.runner import score_problem
from reward_models.verifiers import get_verifier

_DESCRIPTION = """Scores model responses with one of vlrft's rule verifiers and reports the benchmark metrics
of eval.metrics.summarize: accuracy (mean pass@1) with a bootstrap 95% CI, pass@k and maj@k for every k
up to n, format rate, mean response length. predictions: per problem, its n responses (strings);
references: per problem, the reference answer. verifier: a name in reward_models.verifiers.VERIFIERS."""


class RuleVerifier(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("string")), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, verifier="math_boxed"):
        v = get_verifier(verifier)
        rows = [
            score_problem(PromptRecord(id=str(i), prompt="", answer=ref), responses, v)
            for i, (responses, ref) in enumerate(zip(predictions, references))
        ]
        return summarize(rows)
