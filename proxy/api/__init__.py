"""HTTP front ends: one shared core (``jsonio``, ``context``, ``content``, ``output``,
``streaming``), one module per wire dialect (``responses`` + ``responses_stream``, ``chat``),
and the trainer-side routes (``training``, ``admin``)."""
