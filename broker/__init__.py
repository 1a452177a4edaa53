"""The MQTT broker edgebus can run itself, for plants without a Mosquitto of their own.

Its modules are imported by name (broker.embedded, broker.mosquitto, ...), not through this
package, so that what imports one (a stage's fit check finds Mosquitto for the profile)
does not load the embedded broker's amqtt with it.
"""
