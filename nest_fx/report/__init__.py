"""Presentation: what the command line and the benchmarks print and draw.

``tables`` (trace, plan, simulation, baseline and profile tables; number formats), ``layout``
(rank groups per network level and device orders), ``timeline`` (an event simulation of a
pipeline schedule), ``explain`` (a plan file in words), ``gantt`` and ``plotting`` (figures,
through the optional matplotlib extra).
"""
