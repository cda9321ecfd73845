"""Default connection timeouts and the shutdown grace period of `pagedllm serve`.

Plain numbers in a module that imports nothing, so the command line can show them without
importing the web server.
"""

DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request head must arrive within this
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body must arrive within this
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle connection between requests is closed after this
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # SIGTERM: running requests get this long to finish
