"""`gnsweep laws` as text: the cells, each law with its intervals, the held-out check, the
prediction and the published references, from the content of laws.json. Writes no file."""

from __future__ import annotations

from typing import Any

QUANTITY_NAMES = {"batch_size": "B_opt", "learning_rate": "lr_opt", "b_crit": "B_crit"}


def _g(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _interval(value: Any, low: Any, high: Any) -> str:
    return f"{_g(value)} [{_g(low)}, {_g(high)}]"


def format_laws(data: dict[str, Any]) -> str:
    """The printed summary of laws.json's content (docs/laws.md)."""
    lines = []
    kind = data.get("kind", "")
    tolerance = data.get("tolerance")
    head = f"laws across scale ({kind.replace('_', ' ')}"
    head += f", near-optimal within {tolerance:.2%} of the best loss)" if tolerance else ")"
    lines.append(head)
    if data.get("tolerance_source"):
        lines.append(f"tolerance: {data['tolerance_source']}")
    lines.append(f"{'N':>10} {'D':>10} {'target':>8} {'B_opt':>10} {'lr_opt':>10} {'loss':>9} "
                 f"{'B_crit':>10}  note")
    for cell in data["cells"]:
        note = f"edge: {cell.get('edge_reason')}" if cell.get("edge") else ""
        status = cell.get("b_crit_status")
        crit = _g(cell.get("b_crit"))
        if status == "lower_bound":
            crit = ">" + crit
        elif status not in ("fit", None):
            crit = "-"
        lines.append(f"{_g(cell['N']):>10} {_g(cell['D']):>10} {_g(cell.get('target')):>8} "
                     f"{_g(cell['batch_size']):>10} {_g(cell['learning_rate']):>10} "
                     f"{_g(cell['loss']):>9} {crit:>10}  {note}")
    lines.append("")
    for law in data["laws"]:
        name = QUANTITY_NAMES.get(law["quantity"], law["quantity"])
        target = (f" (target {law['target']:g})" if law.get("target") is not None
                  else f" ({law['scope']})" if law.get("scope") else "")
        coefficients = ", ".join(f"{k} = {_interval(v['value'], v['low'], v['high'])}"
                                 for k, v in law["coefficients"].items())
        lines.append(f"{name}{target} = {law['form']}: {coefficients}  "
                     f"({law['n_points']} cells, rmse log {law['rmse_log']:.3f}; 95% bootstrap)")
        if law.get("alpha_B"):
            alpha = law["alpha_B"]
            lines.append(f"  Kaplan's B_crit(L) = B* / L^(1/alpha_B): B* = "
                         f"{_g(law['coefficients']['c']['value'])}, alpha_B = "
                         f"{_interval(alpha['value'], alpha['low'], alpha['high'])}")
        for reason in law.get("form_reason", []):
            lines.append(f"  form: {reason}")
        held = law["held_out"]
        if held.get("predicted") is not None:
            predicted = _interval(held["predicted"], held["predicted_low"],
                                  held["predicted_high"])
            lines.append(f"  held out N={_g(held['N'])} D={_g(held['D'])}"
                         + (f" target {_g(held['target'])}" if held.get("target") else "")
                         + ": predicted "
                         f"{predicted}, measured {_g(held['measured'])} "
                         f"(ratio {held['ratio']:.3g})")
        else:
            lines.append(f"  held out N={_g(held['N'])} D={_g(held['D'])}: no check "
                         f"({held.get('refused', '')})")
    for refused in data.get("refused", []):
        name = QUANTITY_NAMES.get(refused["quantity"], refused["quantity"])
        lines.append(f"{name}: no law ({refused['reason']})")
    loss = data.get("held_out_loss")
    if loss:
        lines.append(f"held-out cell N={_g(loss['N'])} D={_g(loss['D'])}: the grid point nearest "
                     f"the predicted (B, lr) is B={_g(loss['batch_size'])} "
                     f"lr={_g(loss['learning_rate'])}, loss {_g(loss['loss'])} against the best "
                     f"{_g(loss['best_loss'])} ({loss['excess']:+.2%})")
    prediction = data.get("prediction")
    if prediction:
        lines.append("")
        lines.append(f"prediction at N={_g(prediction['N'])} D={_g(prediction['D'])} "
                     f"({prediction['extrapolation']:.3g}x beyond the largest swept scale: "
                     f"N {prediction['extrapolation_N']:.3g}x, D "
                     f"{prediction['extrapolation_D']:.3g}x):")
        for quantity in ("batch_size", "learning_rate", "b_crit"):
            if prediction.get(quantity) is not None:
                lines.append(f"  {QUANTITY_NAMES[quantity]} = "
                             + _interval(prediction[quantity], prediction[f"{quantity}_low"],
                                         prediction[f"{quantity}_high"]))
        refs = prediction.get("references") or {}
        if refs:
            lines.append(f"  for reference only, Step Law (AdamW language models, tokens) at "
                         f"this N, D: B {_g(refs.get('step_law_batch_size'))}, lr "
                         f"{_g(refs.get('step_law_learning_rate'))}")
        if refs.get("deepseek_batch_size") is not None:
            lines.append(f"  for reference only, DeepSeek LLM (AdamW language models, tokens) at "
                         f"C = M D = {_g(refs['compute'])} FLOPs: B "
                         f"{_g(refs['deepseek_batch_size'])}, lr "
                         f"{_g(refs['deepseek_learning_rate'])}")
        for note in prediction.get("notes", []):
            lines.append(f"  note: {note}")
    if data.get("references"):
        lines.append("")
        lines.append("published laws, for reference only (other models, AdamW, other units; "
                     "not fitted here):")
        for ref in data["references"]:
            lines.append(f"  {QUANTITY_NAMES.get(ref['quantity'], ref['quantity'])} = "
                         f"{ref['form']}  [{ref['source']}; {ref['unit']}]")
    for warning in data.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
