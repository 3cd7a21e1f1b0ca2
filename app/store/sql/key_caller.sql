-- A request's API key and its tenant, by the key's hash, in one statement
-- (store.api_keys.authenticate): the key's own columns under key_ names, the tenant's
-- row whole (every column of tenants, read as a detached Tenant), and the
-- database's now() that expiry and revocation are judged at, and whether a dollar
-- budget applies to the key (its tenant's or its own: none, its calls reserve nothing).
SELECT k.id AS key_id, k.name AS key_name, k.scopes AS key_scopes,
       k.requests_per_min AS key_requests_per_min, k.expires_at AS key_expires_at,
       k.revoked_at AS key_revoked_at, k.last_used_at AS key_last_used_at,
       now() AS key_checked_at,
       EXISTS (SELECT 1 FROM money_budgets AS b
               WHERE b.tenant_id = k.tenant_id AND (b.key_id IS NULL OR b.key_id = k.id))
           AS key_has_budget,
       t.*
FROM api_keys AS k JOIN tenants AS t ON t.id = k.tenant_id
WHERE k.key_hash = :key_hash
