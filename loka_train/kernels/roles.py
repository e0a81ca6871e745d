"""The three GEMMs of a linear layer (a *site*), named once for every part of loka_train.

A linear layer ``y = x W^T`` runs three GEMMs, each planned, probed and timed on its own:

* ``forward``: ``y = x W^T`` (contraction over the input features ``K``);
* ``grad_input``: ``dX = dY W`` (contraction over the output features ``N``);
* ``grad_weight``: ``dW = dY^T X`` (contraction over the rows ``M``).

:class:`Role` is a ``StrEnum``: a member equals its string (``Role.FORWARD == "forward"``), so
plans, checkpoints and reports keep the plain strings. :data:`ROLES` holds those strings in
the order every table and buffer uses.

Example:
    >>> from loka_train.kernels.roles import ROLES, Role
    >>> ROLES
    ('forward', 'grad_input', 'grad_weight')
    >>> Role("grad_input") is Role.GRAD_INPUT
    True
"""

from __future__ import annotations

import enum

__all__ = ["ROLES", "Role"]


class Role(enum.StrEnum):
    """One GEMM of a linear layer."""

    FORWARD = "forward"
    """``y = x W^T``."""
    GRAD_INPUT = "grad_input"
    """``dX = dY W``."""
    GRAD_WEIGHT = "grad_weight"
    """``dW = dY^T X``."""


ROLES: tuple[str, ...] = tuple(role.value for role in Role)
"""The role names as plain strings, in order: ``("forward", "grad_input", "grad_weight")``."""
