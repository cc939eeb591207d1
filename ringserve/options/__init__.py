"""The option table: every flag of every service and of ``ringserve launch``, declared once.

Each service's options are the fields of a frozen dataclass here (``scheduler.EngineOptions``
and ``SchedulerOptions``, ``tokenizer.TokenizerOptions``, ``gateway.GatewayOptions``,
``detokenizer.DetokenizerOptions``); the services' config dataclasses subclass them. From
the table come each service's argparse (``parse.ConfigParser``), the launcher's flags and
what it passes to each service (``launch``, ``table.pass_through``), docs/flags.md
(``reference``, ``python -m ringserve.options --markdown``) and the Helm chart's checks
(tests/deploy/test_helm_options.py). Choice lists are the registries' names (``names``).

Adding an option: one field in the service's dataclass here, e.g.

    max_foo: int = option("--max-foo", 8, check=AtLeast(1), launch=True, chart="config.scheduler.maxFoo",
                          help="...")

(``launch=True``: ``ringserve launch`` has it too and passes it on; ``chart``: the
values.yaml key that sets it, or ``not_in_chart="why"``), then its use (``cfg.max_foo``)
and, for ``chart``, the value in the chart. Regenerate docs/flags.md.

Torch-free, and it imports nothing from ``services/``.
"""
