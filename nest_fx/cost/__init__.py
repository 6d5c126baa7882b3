"""Cost model: compute, collective, memory and step-time estimates (SI units throughout)."""
