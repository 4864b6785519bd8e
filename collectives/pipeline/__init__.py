"""Lesson 14: pipeline parallelism from send and recv.

* :mod:`.stage` -- a model of equal layers cut into chunks; a :class:`Stage` runs one chunk
  with the backward split into B (input gradient) and W (weight gradient);
* :mod:`.schedules` -- schedules as data, a list of F/B/W steps per rank: GPipe, 1F1B,
  interleaved 1F1B and ZB-H1;
* :mod:`.simulate` -- every schedule played on paper first: complete, deadlock-free (a
  :class:`Deadlock` names the cycle), its timeline, bubble and memory;
* :mod:`.basic` -- one stage per rank, as the exercise builds it: the forward pass with
  its shapes agreed once, a GPipe step, and any rank's order of F, B and W run;
* :mod:`.runner` -- one runner for every schedule: activations and gradients as tagged
  ``isend``/``irecv`` messages, shapes agreed once;
* :mod:`.torch_pp` -- the same model and stages through ``torch.distributed.pipelining``;
* :mod:`.cost` -- bubble and memory formulas, and the bytes across a slow link against
  data parallel's.
"""

from . import cost
from .basic import gpipe_step, pipeline_forward, run_schedule
from .runner import SHAPE_SLOTS, Pipeline, make_pipeline, shape_from, shape_message, tag
from .schedules import (
    NAMES,
    Step,
    from_orders,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    one_f_one_b_order,
    schedule,
    zb_h1,
    zb_h1_order,
)
from . import measure
from .simulate import Deadlock, InvalidSchedule, Timeline, simulate, validate
from .stage import Stage, as_module, chunk_layers, loss_grad, loss_value, make_layers, one_process

__all__ = ["Stage", "make_layers", "chunk_layers", "loss_grad", "loss_value", "as_module", "one_process",
           "Step", "gpipe", "one_f_one_b", "one_f_one_b_order", "interleaved_1f1b", "zb_h1", "zb_h1_order",
           "schedule", "from_orders", "NAMES", "simulate", "validate", "Deadlock", "InvalidSchedule", "Timeline",
           "Pipeline", "make_pipeline", "pipeline_forward", "gpipe_step", "run_schedule", "shape_message",
           "shape_from", "tag", "SHAPE_SLOTS", "cost", "measure"]
