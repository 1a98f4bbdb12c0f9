# From langchain-ai/langgraph-supervisor-py's README.md, "Quickstart" (langgraph-supervisor
# 0.0.31), unchanged below this header. Copyright (c) 2025 LangChain, Inc. MIT License.
#
# A LangGraph supervisor managing two create_react_agent agents (math_expert, research_expert).
# Under `lightspan rollout` it needs nothing but a model named gpt-4o (`lightspan vllm --aliases
# gpt-4o`); with opentelemetry-instrumentation-langchain each call is attributed to the agent
# whose graph made it (supervisor, math_expert or research_expert), so
#     lightspan transitions build --agent-match '^supervisor$'
# trains the supervisor's calls only. It emits no reward: a grader posts one per rollout
# (POST /v1/rewards).

from langchain_openai import ChatOpenAI

from langgraph_supervisor import create_supervisor
from langgraph.prebuilt import create_react_agent

model = ChatOpenAI(model="gpt-4o")

# Create specialized agents

def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b

def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b

def web_search(query: str) -> str:
    """Search the web for information."""
    return (
        "Here are the headcounts for each of the FAANG companies in 2024:\n"
        "1. **Facebook (Meta)**: 67,317 employees.\n"
        "2. **Apple**: 164,000 employees.\n"
        "3. **Amazon**: 1,551,000 employees.\n"
        "4. **Netflix**: 14,000 employees.\n"
        "5. **Google (Alphabet)**: 181,269 employees."
    )

math_agent = create_react_agent(
    model=model,
    tools=[add, multiply],
    name="math_expert",
    prompt="You are a math expert. Always use one tool at a time."
)

research_agent = create_react_agent(
    model=model,
    tools=[web_search],
    name="research_expert",
    prompt="You are a world class researcher with access to web search. Do not do any math."
)

# Create supervisor workflow
workflow = create_supervisor(
    [research_agent, math_agent],
    model=model,
    prompt=(
        "You are a team supervisor managing a research expert and a math expert. "
        "For current events, use research_agent. "
        "For math problems, use math_agent."
    )
)

# Compile and run
app = workflow.compile()
result = app.invoke({
    "messages": [
        {
            "role": "user",
            "content": "what's the combined headcount of the FAANG companies in 2024?"
        }
    ]
})
