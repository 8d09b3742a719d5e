"""A user reward written the way a math task writes one (`math_reward:equal`): sympy, imported at module level,
decides whether the response and the ground truth are the same number. `agent_tool.py` scores through it."""

import sympy


def equal(response, ground_truth, *, finish_reason, extra_info):
    try:
        return 1.0 if sympy.simplify(sympy.sympify(response) - sympy.sympify(ground_truth)) == 0 else 0.0
    except (sympy.SympifyError, TypeError):
        return 0.0
