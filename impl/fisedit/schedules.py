"""FISEdit's two edit schedules as registered components (what each ``system.schedule`` name
stands for): the edit mask supplied with the request, or captured online after k dense steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from impl.common.registry import Registry

MASK_CAPTURE_S = 1e-3  # [R] D2H of k latents + Otsu + opening on a 96^2 map, host side


@dataclass(frozen=True)
class EditSchedulePolicy:
    # the mask is captured from the latents after k dense steps (else it comes with the request)
    captures_mask: bool
    # sim: what the capture adds to one edit
    mask_capture_s: float = 0.0

    def mask_args(self, mask: Optional[object]) -> dict:
        """``FISEditPipeline.edit``'s mask arguments for a known mask: the request's own mask,
        or an override of the captured one (a controlled ratio, after the capture was paid)."""
        if self.captures_mask:
            return {"mask": None, "mask_override": mask}
        return {"mask": mask, "mask_override": None}


EDIT_SCHEDULES: Registry[EditSchedulePolicy] = Registry("value", "system.schedule")
EDIT_SCHEDULES.add("supplied", EditSchedulePolicy(captures_mask=False))
EDIT_SCHEDULES.add("online", EditSchedulePolicy(captures_mask=True, mask_capture_s=MASK_CAPTURE_S))
