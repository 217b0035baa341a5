"""Functions the task YAML files in this folder name with `!function utils.NAME` (lm-eval imports this file by
path). They live in `attnres_hf.eval.task_utils`, where they are documented and tested."""

from attnres_hf.eval.task_utils import (  # noqa: F401
    PoolSampler,
    build_humaneval_program,
    load,
    mmlu_pro_doc_to_text,
    mmlu_pro_fewshot_target,
    mmlu_pro_fewshot_text,
    pass_at_1,
    process_cmath,
    process_gpqa,
    process_gsm8k,
    process_hellaswag,
    process_math,
    process_mgsm,
)
from attnres_hf.eval.scoring import bbh_filter, letter_filter, numeric_filter  # noqa: F401
