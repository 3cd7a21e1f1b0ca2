"""One HTTP client for the tests' own requests (to the simulator, batchgen's API,
Flower, the dashboard ...).

``httpx.get()`` and its siblings build a client for each call, and with it a TLS
context: about 36 ms of CPU each time, which a poll ten times a second paid ten times
a second. These functions take the same arguments and share one client. Like them,
it keeps nothing between requests: no connection (the servers it talks to come and go
between tests) and no cookie (a signed-in test would sign in the next): a request
that needs one sends it in a ``Cookie`` header.
"""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

DEFAULT_TIMEOUT_S = 5.0  # httpx's own default for a request that names none

_client = httpx.Client(
    timeout=DEFAULT_TIMEOUT_S,
    limits=httpx.Limits(max_keepalive_connections=0),
    cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),  # keeps none
)

request = _client.request
get = _client.get
post = _client.post
put = _client.put
patch = _client.patch
delete = _client.delete
head = _client.head
stream = _client.stream
