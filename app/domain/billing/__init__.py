"""Money, decided from plain values (pure): a call's cost and the dollar budgets' maths."""
