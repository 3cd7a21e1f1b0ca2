"""Pure decisions: no I/O, no clock but the one passed in.

In subject rooms: ``formats`` (requests and answers: endpoints, admission of request
lines, token counting, the native formats), ``scheduling`` (fair rounds, shares, rate
limits, pools, routes, offload), ``lifecycle`` (status values and their legal moves,
deadlines, retry timing, what to do after a failure) and ``billing`` (cost, dollar
budgets); API keys and notifications at the top. Everything above (store, limits,
worker) asks these functions and then does the I/O.
"""
