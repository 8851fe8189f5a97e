"""How calls reach the supervisor: ``base.ClientSide``, a bound ROUTER (``router``) or a link to a broker
(``brokerlink``), shaped like httpx's transports."""
