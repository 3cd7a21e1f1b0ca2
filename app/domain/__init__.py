"""Pure decisions: no I/O, no clock but the one passed in.

Status values and their legal moves, deadlines, retry timing, what to do after
a failure or a budget denial, admission of request lines, token counting and
cost. Everything above (store, limits, worker) asks these functions and then
does the I/O.
"""
