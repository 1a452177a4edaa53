"""Gateways that put the plant's MQTT request contract behind other protocols.

`http`: the OpenAI-compatible HTTP API (`edgebus http PLANT`), for editors,
scripts and chat front-ends that speak it.
"""
