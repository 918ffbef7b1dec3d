"""FedRolex: HeteroFL with a rolling sub-model window.

Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction",
NeurIPS 2022, Sec. 3 (Eq. 4). HeteroFL gives a client of width ``r`` always the same leading
``ceil(r * C)`` channels of a layer, so the channels beyond the narrowest clients' prefix are
trained only by the wide clients. FedRolex moves the window by one channel per round: in round ``t``
the client holds channels ``(s + j) mod C``, ``j = 0..ceil(r * C) - 1``, ``s = (t - 1) mod C``, so
over ``C`` rounds every channel is trained by every client.

Everything else is :class:`rafl.federation.algorithms.heterofl.HeteroFL` (aggregation over the
holders of each element, ``weighting``, ``static_bn``, ``scaler``, payloads and bytes):

* width-sliced models: the window rolls along every dimension narrower than the global model's
  (the hidden layers' channels; a layer's input uses its producer's window, since both have ``C``);
* NAS subnets: it rolls along the elastic expand dimension of every block (the expanded channels
  that OFA's elastic width slices, :func:`rafl.federation.weight_sharing.roll_middle_channels`);
  depth stays the first ``d`` blocks and the kernel the centre of the largest one, as in HeteroFL.
  The window no longer starts at OFA's most important channels after round 1.

Evaluation uses the client's window of the next round (the slice it would download now).

Where each step lives: the window, the one change,
:func:`rafl.federation.algorithms.heterofl.index_map` with :attr:`FedRolex.rolling`
(:func:`rafl.federation.weight_sharing.rolled`; NAS subnets: the shifts of
:func:`rafl.federation.weight_sharing.nas_index_map`); every other step is :class:`HeteroFL`'s.
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.algorithms.base import register
from rafl.federation.algorithms.heterofl import HeteroFL


@register
class FedRolex(HeteroFL):
    """FedRolex (Alam et al., NeurIPS 2022): HeteroFL with a window rolling one channel per round."""

    name: ClassVar[str] = "fedrolex"
    rolling: ClassVar[bool] = True
