    -- The results' queue waits and upstream latencies of the items in CTE ended, counted
    -- per model, metric and histogram bucket (le_ms: the smallest bound of :bounds_ms at
    -- or above the value, 2147483647 = store.totals.LE_INF_MS above them all).
    SELECT e.model, m.metric,
           coalesce(
               (SELECT min(b) FROM unnest(CAST(:bounds_ms AS integer[])) AS b WHERE b >= m.ms),
               2147483647
           ) AS le_ms,
           count(*) AS n, sum(m.ms) AS sum_ms
    FROM ended AS e
    JOIN results AS r ON r.item_id = e.id
    CROSS JOIN LATERAL (
        VALUES ('queue_wait', r.queue_wait_ms), ('upstream', r.upstream_latency_ms)
    ) AS m (metric, ms)
    GROUP BY 1, 2, 3