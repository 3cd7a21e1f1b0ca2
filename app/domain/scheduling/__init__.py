"""Who runs when, and where, decided from plain values (pure): fair rounds, shares,
slot reserves, rate limits, pools, routes, offload, autoscaling, the gate's rebuild."""
