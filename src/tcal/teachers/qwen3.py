"""Qwen3 family: per-head q_norm / k_norm before RoPE, which the GDN drops (it l2-normalizes q and k)."""

from tcal.teachers.base import TeacherAdapter

QWEN3 = TeacherAdapter(family="qwen3",
                       dropped=("q_norm.weight", "k_norm.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"))
