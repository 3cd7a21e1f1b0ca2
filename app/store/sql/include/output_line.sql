    -- One line of a batch's output file (a succeeded item, with its result r) or error
    -- file (the others: OpenAI's codes for requests never run to their end), as OpenAI
    -- writes them, built from item i and its result r (NULL unless succeeded). The file
    -- is streamed from these lines, and its size is the sum of their bytes, rolled up
    -- with the totals: both come from this one expression.
    CASE WHEN i.status = 'succeeded' THEN
        '{"id": "batch_req_' || i.id || '", "custom_id": ' || to_json(i.custom_id)::text
        || ', "response": {"status_code": 200, "request_id": '
        || coalesce(to_json(r.provider_request_id)::text, 'null')
        || ', "body": ' || coalesce(r.response::text, 'null') || '}, "error": null}'
    ELSE
        '{"id": "batch_req_' || i.id || '", "custom_id": ' || to_json(i.custom_id)::text
        || ', "response": null, "error": {"code": '
        || to_json(CASE coalesce(i.error_code, i.status)
                       WHEN 'expired' THEN 'batch_expired'
                       WHEN 'cancelled' THEN 'batch_cancelled'
                       ELSE coalesce(i.error_code, i.status) END)::text
        || ', "message": ' || coalesce(to_json(i.last_error)::text, 'null') || '}}'
    END || E'\n'
